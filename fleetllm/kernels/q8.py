"""Q8_0 weights recovered from their fp32 dequantisation, and the C GEMV that reads them (``q8_gemv.c``).

A Q8_0 GGUF weight is ``w = d * q`` per group of 32 inputs (``q`` in -127..127, ``d`` fp16), and the
loader's fp32 weight is exactly that product in fp32. :func:`recover_q8_0` finds ``q`` and ``d`` back
(``d``: the group's ``max |w| / 127`` rounded to fp16, 0 for an all-zero group) and keeps them only when
``d * q`` gives every weight back bit for bit; any other weight gets None and stays fp32. The kernel then
computes with fp32 activations the same weights' GEMV, up to summation order. SmolLM2's LM head (tied to
the token embedding) is Q8_0 in its Q4_1 GGUF: a quarter of the fp32 head's bytes per decode step.

The library builds in the background on first use, as the Q4 one does (:mod:`fleetllm.kernels.q4`, whose
switch, ``FLEETLLM_Q4_KERNEL=eager`` or :func:`fleetllm.kernels.q4.set_kernel_enabled`, covers this kernel
too); until then, or without a compiler, :func:`q8_linear` returns None and the caller takes its fp32 path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from fleetllm.kernels import q4
from fleetllm.kernels.build import KernelLibrary

GROUP = 32


def _declare(lib: ctypes.CDLL) -> None:
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.q8_gemv.argtypes = [p, L, p, p, p, L, i, i, i, i, i]
    lib.q8_gemv.restype = i
    lib.q8_i16_gemv.argtypes = [p, L, p, p, p, L, i, i, i, i, i]
    lib.q8_i16_gemv.restype = i
    lib.q8_gemv_isa.restype = i
    lib.q8_recover.argtypes = [p, L, i, p, p, i]
    lib.q8_recover.restype = i


LIBRARY = KernelLibrary(Path(__file__).with_name("q8_gemv.c"), _declare)


@dataclass(frozen=True)
class Q8Weight:
    """One ``[N, K]`` weight as the kernel reads it: levels ``q [N, K]`` int8 and scales ``d [N, K/32]`` fp32."""

    q: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``d * q``, rounded as the GGUF loader rounds it."""
        n, k = self.shape
        return (self.d.unsqueeze(-1) * self.q.reshape(n, k // GROUP, GROUP).float()).reshape(n, k)


def recover_q8_0(w: torch.Tensor) -> Q8Weight | None:
    """``w [N, K]``'s exact Q8_0 form, or None when ``w`` is not a Q8_0 dequantisation (see the module doc).

    One pass in C (``q8_recover``) when the library builds, else the same arithmetic in PyTorch.
    """
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % GROUP != 0:
        return None
    n, k = w.shape
    lib = LIBRARY.get(wait=True) if q4.kernel_enabled() else None
    if lib is not None and w.is_contiguous():
        out = Q8Weight(torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // GROUP))
        status = lib.q8_recover(w.data_ptr(), n, k, out.q.data_ptr(), out.d.data_ptr(), torch.get_num_threads())
        if status >= 0:
            return out if status == 1 else None
    return recover_q8_0_eager(w)


def recover_q8_0_eager(w: torch.Tensor) -> Q8Weight | None:
    """:func:`recover_q8_0` in PyTorch (the C path's reference; CPUs without AVX2/F16C)."""
    n, k = w.shape
    wg = w.detach().reshape(n, k // GROUP, GROUP)
    d = (wg.abs().amax(-1) / 127).half().float()
    if not torch.isfinite(d).all():
        return None
    step = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    q = (wg / step).round_().clamp_(-127, 127).to(torch.int8)
    weight = Q8Weight(q.reshape(n, k).contiguous(), d.contiguous())
    return weight if torch.equal(weight.dequantize(), w.detach()) else None


def kernel_ready(wait: bool = False) -> bool:
    """Whether the C kernel is loaded and enabled; the first call starts its build (``wait``: and waits)."""
    return q4.kernel_enabled() and LIBRARY.get(wait) is not None


def q8_linear(x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None = None,
              vector: bool = True) -> torch.Tensor | None:
    """``x [..., K] @ W^T (+ bias)`` in fp32 through the kernel; None when it does not serve this call.

    ``vector=False`` takes the kernel's scalar path even on an AVX2 CPU (the tests' way to reach it).
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or not kernel_ready():
        return None
    n, k = weight.shape
    return q4.gemv(x, n, k, bias, "q8_gemv", lambda rows, out: LIBRARY.lib.q8_gemv(
        rows.data_ptr(), rows.stride(0), weight.q.data_ptr(), weight.d.data_ptr(), out.data_ptr(), n,
        rows.shape[0], n, k, torch.get_num_threads(), int(vector)))


def q8_i16_linear(x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None = None,
                  vector: int = 3) -> torch.Tensor | None:
    """:func:`q8_linear` with each row of ``x`` first rounded to int16 per group of 32 inputs (scale
    ``max |x| / 32767``) and integer dot products (``q8_i16_rows.h``): the arithmetic of the ``q4`` default's
    narrow linears, for the Q8_0 weights a GGUF keeps at load. None when the kernel does not serve this call.
    ``vector`` picks the instruction set (tests): 0 the scalar path, 2 AVX2, 3 the best (AVX-512 VNNI where there is one).
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or not kernel_ready():
        return None
    n, k = weight.shape
    return q4.gemv(x, n, k, bias, "q8_i16_gemv", lambda rows, out: LIBRARY.lib.q8_i16_gemv(
        rows.data_ptr(), rows.stride(0), weight.q.data_ptr(), weight.d.data_ptr(), out.data_ptr(), n,
        rows.shape[0], n, k, torch.get_num_threads(), vector))
