"""Paged attention: queries read K/V straight from the blocks of their block tables (no gather).

The interface is the one a GPU kernel (FlashInfer / vLLM ``paged_attention``-style) plugs into: queries
``[R, H, D]``, one layer's flat caches ``[num_blocks * block_size, kv_heads, head_dim]`` (8-bit caches:
``kv8.row_width(head_dim)``, the values and their scales, read in place; see :mod:`.kv8`), int32 block tables
``[S, max_blocks]`` and per-row context lengths. Row ``r`` reads table row ``table_of[r]`` (default: ``r``)
and attends to its last ``window`` (default: all) of ``context_lens[r]`` positions, the newest of which is
its own. A decode step is one row per sequence; a chunk of ``n`` queries over cached context is ``n`` rows
sharing one table with lengths ``n_ctx - n + 1 ... n_ctx``.

Backends: the C kernel (``paged_attention.c``, AVX2 or scalar, OpenMP) on the CPU, built in the background
on first use; :func:`reference_attention` (gather + softmax in PyTorch) everywhere else and while the kernel
builds. ``FLEETLLM_ATTENTION=eager`` (or :func:`set_kernel_enabled`) keeps every call on the eager path.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from fleetllm.kernels import kv8
from fleetllm.kernels.build import KernelLibrary

# the cache dtypes the C kernels read, by their code there (8-bit ones: rows of values and a scale, see kv8)
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3, torch.float8_e4m3fn: 4,
             torch.float8_e5m2: 5}
_enabled = os.environ.get("FLEETLLM_ATTENTION", "auto") != "eager"


def _declare(lib: ctypes.CDLL) -> None:
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.paged_attention.argtypes = [p, L, p, p, i, p, i, p, p, p, L, i, i, i, i, i, i, ctypes.c_float, i]
    lib.paged_attention.restype = i
    lib.paged_attention_isa.restype = i


LIBRARY = KernelLibrary(Path(__file__).with_name("paged_attention.c"), _declare)


def set_kernel_enabled(enabled: bool) -> None:
    """Route every call through the C kernel when it is built (True, the default) or the eager path (False)."""
    global _enabled
    _enabled = enabled


def kernel_enabled() -> bool:
    """Whether calls may take the C kernel (see :func:`set_kernel_enabled`)."""
    return _enabled


def kernel_ready(q: torch.Tensor, k_cache: torch.Tensor, wait: bool = False) -> bool:
    """Whether the C kernel serves these tensors now; the first call starts its build (``wait``: and waits)."""
    if not _enabled or q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype not in KV_DTYPES:
        return False
    return LIBRARY.get(wait) is not None


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, block_size: int, window: int | None = None,
    table_of: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [R, H, D]`` over the paged cache (see the module doc); writes ``out`` when given.

    ``q`` and ``out`` may be row-strided views (e.g. the query columns of a fused qkv output), with their
    heads and dims contiguous.
    """
    if not kernel_ready(q, k_cache):
        res = reference_attention(q, k_cache, v_cache, block_tables, context_lens, scale, block_size, window, table_of)
        return res if out is None else out.copy_(res)
    rows, heads, dim = q.shape
    if out is None:
        out = torch.empty(rows, heads, dim, dtype=q.dtype)
    _check_layout(q, out, k_cache, v_cache, block_tables, context_lens, table_of)
    rc = LIBRARY.lib.paged_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPES[k_cache.dtype],
        block_tables.data_ptr(), block_tables.stride(0), 0 if table_of is None else table_of.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(), out.stride(0), rows, heads, k_cache.shape[1], dim, block_size, window or 0, scale,
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged attention: no memory for its score buffers")
    return out


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, block_size: int, window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (row ``i`` of ``q`` reads table row ``i``); see :func:`paged_attention`."""
    return paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, block_size, window, out=out)


def chunk_rows(n_queries: int, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table_of, context_lens)`` for a chunk of ``n_queries`` queries ending at context length ``n_ctx``."""
    lens = torch.arange(n_ctx - n_queries + 1, n_ctx + 1, dtype=torch.int32)
    return torch.zeros(n_queries, dtype=torch.int32), lens


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, block_size: int, window: int | None = None,
    table_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in PyTorch, row by row through gathered K/V: the eager backend and the tests' oracle."""
    rows, heads, dim = q.shape
    g = heads // k_cache.shape[1]
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    for r in range(rows):
        n = int(context_lens[r])
        first = max(0, n - window) if window else 0
        table = block_tables[r if table_of is None else int(table_of[r])].long()
        pos = torch.arange(first, n, device=q.device)
        slots = table[pos // block_size] * block_size + pos % block_size
        k = kv8.read(k_cache, slots, q.dtype).repeat_interleave(g, dim=1).transpose(0, 1)  # [H, L, D]
        v = kv8.read(v_cache, slots, q.dtype).repeat_interleave(g, dim=1).transpose(0, 1)
        probs = torch.softmax((k @ q[r].unsqueeze(-1)).squeeze(-1) * scale, dim=-1)  # [H, L]
        out[r] = (probs.unsqueeze(1) @ v).squeeze(1)
    return out


def _check_layout(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, table_of: torch.Tensor | None) -> None:
    """The C kernel reads raw pointers: shapes, dtypes and strides must be what it assumes, or it reads garbage."""
    rows, heads, dim = q.shape
    ok = (q.stride(2) == 1 and q.stride(1) == dim and out.stride(2) == 1 and out.stride(1) == dim
          and out.dtype == torch.float32 and out.shape == q.shape
          and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
          and kv8.head_dim_of(k_cache) == dim and heads % k_cache.shape[1] == 0
          and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
          and context_lens.dtype == torch.int32 and context_lens.is_contiguous() and context_lens.shape[0] == rows
          and (table_of is None or (table_of.dtype == torch.int32 and table_of.is_contiguous())))
    if not ok:
        raise ValueError("paged_attention: tensors not in the layout the kernel reads (see the module doc)")
