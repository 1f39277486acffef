"""Each row's own LoRA update added into a projection's output (``lora.c``): the step's multi-adapter products.

A step's rows may each use a different resident adapter (or none): :func:`add_lora` adds
``x[r] @ A[s_r].T @ B[s_r].T`` into ``y[r]`` for every row whose slot ``s_r`` is not -1, reading the stacked
per-slot tables of :class:`fleetllm.lora.tables.LoraTables`. The C kernel groups the rows by slot, so each
adapter's matrices are read once per step whatever the number of its rows; ``y`` may be a column slice of a fused
output (q, k or v of the fused qkv GEMV, gate or up of gate_up), so the update lands before what follows the
projection. Until the kernel is built, or where it cannot run, a grouped PyTorch product (one pair of GEMMs per
adapter in the step) does the same.

The kernel serves the op-by-op path's wide steps (prefill chunks, many rows) too: per rank-16 update of SmolLM2's
shapes (576->576, 1536->576, 576->1536; 2 threads, AMD EPYC, best of 7 with other jobs running) it took 10-12 us
against PyTorch's 36-41 us at one row, 15-26 us against 47-240 us at 8 rows, and at 64-1,024 rows 0.3-0.9x
PyTorch's time with every row on one adapter, 0.2-0.4x with rows spread over eight (noisy figures: a busy machine).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from fleetllm.kernels.build import KernelLibrary
from fleetllm.lora.tables import LoraTables


def _declare(lib: ctypes.CDLL) -> None:
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.lora_apply.argtypes = [p, L, p, L, i, p, i, p, p, i, i, i, i, i]
    lib.lora_apply.restype = i
    lib.lora_isa.restype = i


LIBRARY = KernelLibrary(Path(__file__).with_name("lora.c"), _declare)


def kernel_ready(wait: bool = False) -> bool:
    """Whether the kernel is loaded; the first call starts its build (``wait``: and waits for it)."""
    return LIBRARY.get(wait) is not None


def _fits(t: torch.Tensor) -> bool:
    """A CPU fp32 matrix with unit column stride: what the kernel reads and writes in place."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


def lora_kernel(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                vector: bool = True) -> bool:
    """``y[r] += b[s] @ (a[s] @ x[r])`` for rows with ``s = slots[r] >= 0``, in place through the kernel; False
    (nothing done) when it cannot serve: not built, or tensors it does not take. ``a`` ``[slots, rank, in]`` and
    ``b`` ``[slots, out, rank]`` contiguous fp32; ``x [rows, in]`` and ``y [rows, out]`` with unit column stride
    (``y`` may be a column slice); ``vector=False``: the scalar path (the tests')."""
    if not kernel_ready() or not (_fits(x) and _fits(y)) or not (a.is_contiguous() and b.is_contiguous()):
        return False
    n_slots, rank, fan_in = a.shape
    rows, fan_out = y.shape
    if x.shape != (rows, fan_in) or b.shape != (n_slots, fan_out, rank) or a.dtype != torch.float32:
        return False
    slots = slots.to(torch.int32).contiguous()
    status = LIBRARY.lib.lora_apply(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), rows, slots.data_ptr(),
                                    n_slots, a.data_ptr(), b.data_ptr(), rank, fan_in, fan_out,
                                    torch.get_num_threads(), int(vector))
    if status == -2:
        raise MemoryError("lora: no memory for its scratch")
    if status != 0:
        raise ValueError(f"lora: a slot outside [0, {n_slots}) or a shape it does not take (status {status})")
    return True


def grouped_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """The same update in PyTorch: one shrink and one expand GEMM per adapter the step's rows use."""
    for s in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == s).nonzero().squeeze(1)
        xs = x if rows.shape[0] == x.shape[0] else x.index_select(0, rows)
        delta = (xs @ a[s].T) @ b[s].T
        if rows.shape[0] == x.shape[0]:
            y += delta
        else:
            y.index_add_(0, rows, delta)


def add_lora(y: torch.Tensor, x: torch.Tensor, tables: LoraTables, layer: int, module: str,
             slots: torch.Tensor) -> bool:
    """Add layer ``layer``'s ``module`` update of each row's adapter (``slots [rows]``, -1: none) into ``y`` in
    place; False when no resident adapter adapts ``module`` (nothing to add)."""
    if not tables.active[module] or module not in tables.a[layer]:
        return False
    a, b = tables.a[layer][module], tables.b[layer][module]
    if not lora_kernel(y, x, a, b, slots):
        grouped_delta(y, x, a, b, slots)
    return True
