"""Prefill attention read in place (``prefill_attention.c``): a chunk of queries over its sequence's paged cache.

A prefill chunk of ``n`` queries ending at context length ``n_ctx`` attends causally (and within a sliding
window, when the layer has one) to the positions its block table names, with an online softmax over blocks of
keys: no gather of the context into contiguous K/V, no ``[n, n_ctx]`` score matrix, and no work on the keys a
causal mask would hide. Compared with gather + SDPA, the path it replaces, it reads each key once per tile of
up to 48 (query, head) rows.

The kernel needs AVX-512F and BW, fp32 queries and a head_dim that is a multiple of 16 (at most 256);
:func:`prefill_ready` says whether it serves a call, and the caller keeps SDPA where it does not. It follows
the paged-attention switch (``FLEETLLM_ATTENTION=eager``, :func:`fleetllm.kernels.set_kernel_enabled`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from fleetllm.kernels import attention, kv8
from fleetllm.kernels.build import KernelLibrary

MAX_HEAD_DIM = 256
MAX_GROUP = 48  # query heads per KV head that fit one tile


def _declare(lib: ctypes.CDLL) -> None:
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.prefill_attention.argtypes = [p, L, p, p, i, p, p, L, i, i, i, i, i, i, i, ctypes.c_float, i]
    lib.prefill_attention.restype = i
    lib.prefill_attention_isa.restype = i


LIBRARY = KernelLibrary(Path(__file__).with_name("prefill_attention.c"), _declare)


def prefill_ready(q: torch.Tensor, k_cache: torch.Tensor, wait: bool = False) -> bool:
    """Whether the kernel serves ``q [n, H, D]`` over ``k_cache`` now; the first call starts its build."""
    heads, dim = q.shape[1], q.shape[2]
    shape_ok = dim % 16 == 0 and dim <= MAX_HEAD_DIM and heads // k_cache.shape[1] <= MAX_GROUP
    if not attention.kernel_enabled() or not shape_ok or q.device.type != "cpu" or q.dtype != torch.float32:
        return False
    if k_cache.dtype not in attention.KV_DTYPES:
        return False
    lib = LIBRARY.get(wait)
    return lib is not None and _cpu_runs_it()


@functools.cache
def _cpu_runs_it() -> bool:
    """Whether this CPU has what the loaded kernel needs (AVX-512F and BW): asked once, not per layer."""
    return LIBRARY.lib.prefill_attention_isa() == 1


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
    scale: float, block_size: int, window: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the chunk ``q [n, H, D]`` (positions ``context_len - n ... context_len - 1``) over the cache.

    ``block_table`` is the sequence's int32 table (at least ``ceil(context_len / block_size)`` blocks); the
    chunk's own K/V must already be in the cache. ``q`` and ``out`` may be row-strided views with their heads
    and dims contiguous. Call only where :func:`prefill_ready` is true.
    """
    n, heads, dim = q.shape
    if out is None:
        out = torch.empty(n, heads, dim, dtype=q.dtype)
    ok = (q.stride(2) == 1 and q.stride(1) == dim and out.stride(2) == 1 and out.stride(1) == dim
          and out.shape == q.shape and out.dtype == torch.float32 and k_cache.is_contiguous()
          and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype and kv8.head_dim_of(k_cache) == dim
          and heads % k_cache.shape[1] == 0 and block_table.dtype == torch.int32 and block_table.is_contiguous()
          and block_table.numel() * block_size >= context_len >= n)
    if not ok:
        raise ValueError("prefill_attention: tensors not in the layout the kernel reads (see the module doc)")
    rc = LIBRARY.lib.prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), attention.KV_DTYPES[k_cache.dtype],
        block_table.data_ptr(), out.data_ptr(), out.stride(0), n, context_len, heads, k_cache.shape[1], dim,
        block_size, window or 0, scale, torch.get_num_threads())
    if rc == -2:
        raise MemoryError("prefill attention: no memory for a thread's scratch")
    if rc != 0:
        raise ValueError(f"prefill attention: head_dim {dim} or {heads // k_cache.shape[1]} heads per KV head "
                         "not supported on this CPU")
    return out
