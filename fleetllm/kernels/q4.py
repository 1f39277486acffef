"""Q4_1 weights recovered from their fp32 dequantisation, and the C GEMV that reads them (``q4_gemv.c``).

A Q4_1 GGUF weight is ``w = d * q + m`` per group of 32 inputs (``q`` in 0..15, ``d`` and ``m`` fp16), and
the loader's fp32 weight is exactly that product and sum in fp32. :func:`recover_q4_1` finds ``q``, ``d``
and ``m`` back (``m``: the group's minimum, the ``q = 0`` element; ``d``: ``(max - min) / 15`` rounded to
fp16) and keeps them only when ``d * q + m`` gives every weight back bit for bit; any other weight (an 8-bit
tensor, a trained fp32 one) gets None and stays fp32. The kernel then computes with fp32 activations the
same weights' GEMV, up to summation order.

The library builds in the background on first use (:mod:`fleetllm.kernels.build`); until then, or without
a compiler, :func:`q4_linear` returns None and the caller takes its fp32 path.
``FLEETLLM_Q4_KERNEL=eager`` (or :func:`set_kernel_enabled`) keeps every call there.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fleetllm.kernels.build import KernelLibrary

GROUP = 32
_enabled = os.environ.get("FLEETLLM_Q4_KERNEL", "auto") != "eager"


def _declare(lib: ctypes.CDLL) -> None:
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.q4_gemv.argtypes = [p, L, p, p, p, p, L, i, i, i, i, i]
    lib.q4_gemv.restype = i
    lib.q4_gemv_isa.restype = i
    lib.q4_recover.argtypes = [p, L, i, p, p, p, i]
    lib.q4_recover.restype = i


LIBRARY = KernelLibrary(Path(__file__).with_name("q4_gemv.c"), _declare)


@dataclass(frozen=True)
class Q4Weight:
    """One ``[N, K]`` weight as the kernel reads it: ``packed [N, K/32, 16]`` uint8, ``d`` and ``m [N, K/32]``.

    Byte ``i < 8`` of a group holds levels ``i`` (low nibble) and ``8 + i`` (high); byte ``8 + i`` holds
    levels ``16 + i`` and ``24 + i``.
    """

    packed: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        n, groups, _ = self.packed.shape
        return n, groups * GROUP

    def levels(self) -> torch.Tensor:
        """The levels ``q [N, K/32, 32]`` (uint8), unpacked."""
        lo, hi = self.packed & 15, self.packed >> 4
        return torch.cat([lo[..., :8], hi[..., :8], lo[..., 8:], hi[..., 8:]], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``d * q + m``, rounded as the GGUF loader rounds it."""
        n, k = self.shape
        return (self.d.unsqueeze(-1) * self.levels().float() + self.m.unsqueeze(-1)).reshape(n, k)


def recover_q4_1(w: torch.Tensor) -> Q4Weight | None:
    """``w [N, K]``'s exact Q4_1 form, or None when ``w`` is not a Q4_1 dequantisation (see the module doc).

    One pass in C (``q4_recover``, waiting for the library's build: a second, once per machine), else the
    same arithmetic in PyTorch (about 10× slower: 0.44 s for SmolLM2-135M's 120 linears on 2 cores).
    """
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % GROUP != 0:
        return None
    n, k = w.shape
    lib = LIBRARY.get(wait=True) if _enabled else None
    if lib is not None and w.is_contiguous():
        out = Q4Weight(torch.empty(n, k // GROUP, 16, dtype=torch.uint8), torch.empty(n, k // GROUP),
                       torch.empty(n, k // GROUP))
        status = lib.q4_recover(w.data_ptr(), n, k, out.packed.data_ptr(), out.d.data_ptr(), out.m.data_ptr(),
                                torch.get_num_threads())
        if status >= 0:
            return out if status == 1 else None
    return recover_q4_1_eager(w)


def recover_q4_1_eager(w: torch.Tensor) -> Q4Weight | None:
    """:func:`recover_q4_1` in PyTorch (the C path's reference; CPUs without AVX2/F16C)."""
    n, k = w.shape
    wg = w.detach().reshape(n, k // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d = ((hi - lo) / 15).half().float()
    step = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    q = ((wg - lo.unsqueeze(-1)) / step).round_().clamp_(0, 15).to(torch.uint8)
    packed = torch.cat([q[..., 0:8] | (q[..., 8:16] << 4), q[..., 16:24] | (q[..., 24:32] << 4)], dim=-1)
    weight = Q4Weight(packed.contiguous(), d.contiguous(), lo.contiguous())
    return weight if torch.equal(weight.dequantize(), w.detach()) else None


def set_kernel_enabled(enabled: bool) -> None:
    """Route calls through the C kernel when it is built (True, the default) or to the caller's fp32 path."""
    global _enabled
    _enabled = enabled


def kernel_enabled() -> bool:
    """Whether calls may take the C kernels (this one and :mod:`fleetllm.kernels.q8`'s)."""
    return _enabled


def kernel_ready(wait: bool = False) -> bool:
    """Whether the C kernel is loaded; the first call starts its build (``wait``: and waits for it)."""
    return _enabled and LIBRARY.get(wait) is not None


def q4_linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None,
              vector: bool = True) -> torch.Tensor | None:
    """``x [..., K] @ W^T (+ bias)`` in fp32 through the kernel; None when it does not serve this call.

    ``vector=False`` takes the kernel's scalar path even on an AVX2 CPU (the tests' way to reach it).
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or not kernel_ready():
        return None
    n, k = weight.shape
    return gemv(x, n, k, bias, "q4_gemv", lambda rows, out: LIBRARY.lib.q4_gemv(
        rows.data_ptr(), rows.stride(0), weight.packed.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr(),
        out.data_ptr(), n, rows.shape[0], n, k, torch.get_num_threads(), int(vector)))


def gemv(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, name: str,
         call: Callable[[torch.Tensor, torch.Tensor], int]) -> torch.Tensor:
    """``x [..., k]`` through a GEMV kernel ``call(rows [R, k], out [R, n]) -> status`` (rows with unit column
    stride, ``out`` fresh fp32), plus ``bias``. The kernels' statuses: 0 done, -1 a shape they do not take,
    -2 no memory for their scratch or a CPU without their instructions."""
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    status = call(rows, out)
    if status == -2:
        raise MemoryError(f"{name}: no memory for its scratch, or this CPU lacks its instructions")
    if status != 0:
        raise ValueError(f"{name}: a [{rows.shape[0]}, {k}] -> {n} product it does not take (status {status})")
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)
