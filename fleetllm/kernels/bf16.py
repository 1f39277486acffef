"""bf16 weights and activations, fp32 accumulation (``bf16_gemm.c``): the ``q4`` linears' kernel for wide steps.

Past a few rows a step's GEMMs are compute-bound, and with AVX-512 BF16 one ``vdpbf16ps`` does twice the
multiply-adds of an fp32 FMA with nothing to unpack (the Q4 kernel widens 4-bit levels before each multiply):
per step of SmolLM2's decoder linears at 32 rows it is about twice as fast as the int16 Q4 kernel and fp32 GEMMs
(``benchmarks/q4_gemv.py``). Each weight and activation is rounded to bf16 (8 bits of mantissa, relative error
at most 2^-9 per element, so an outlier coarsens nothing but itself); products and sums are fp32 and so is
the output. The cost is memory: 2 bytes a weight, where the GGUF's Q4_1 takes 0.56.

:class:`PairedBF16` is a weight in the kernel's order (see the C source's comment). The library builds in
the background on first use; until it is loaded, on a CPU without AVX-512 BF16 (:func:`cpu_has_bf16` says so
without building), with the Q4 switch off (``FLEETLLM_Q4_KERNEL=eager``) or this one (:func:`set_enabled`),
:func:`bf16_linear` returns None and the caller takes its fp32 path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from fleetllm.kernels import q4
from fleetllm.kernels.build import KernelLibrary
from fleetllm.kernels.variants import KERNELS, cpu_info

PANEL = 16  # outputs per panel of the paired layout
_enabled = True


def _declare(lib: ctypes.CDLL) -> None:
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.bf16_gemm.argtypes = [p, L, p, p, p, p, L, i, i, i, i, i]
    lib.bf16_gemm.restype = i
    lib.bf16_gemm_isa.restype = i


LIBRARY = KernelLibrary(Path(__file__).with_name("bf16_gemm.c"), _declare)


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU reports AVX-512 BF16 (with F, BW and VL), read from ``/proc/cpuinfo``."""
    return KERNELS["bf16_gemm"].needs <= cpu_info()[1]


@dataclass(frozen=True)
class PairedBF16:
    """One ``[N, K]`` weight rounded to bf16, as ``paired [N / 16, K / 2, 16, 2]``: per panel of 16 outputs and
    pair of inputs, the 16 outputs' two weights side by side."""

    paired: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> PairedBF16 | None:
        """``weight [N, K]`` (fp32) rounded to bf16 and paired; None when N is not a multiple of 16 or K is odd."""
        n, k = weight.shape
        if n % PANEL or k % 2:
            return None
        w16 = weight.detach().to(torch.bfloat16).reshape(n // PANEL, PANEL, k // 2, 2)
        return cls(w16.transpose(1, 2).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        panels, pairs = self.paired.shape[:2]
        return panels * PANEL, pairs * 2

    def unpair(self) -> torch.Tensor:
        """The ``[N, K]`` bf16 weight this was made from."""
        n, k = self.shape
        return self.paired.transpose(1, 2).reshape(n, k)


def set_enabled(enabled: bool) -> None:
    """Route wide steps through the kernel when it is built (True, the default), or to the callers' other paths
    (the decode stack's Q4 GEMM, the linears' fp32 one): the tests hold the stack to the op-by-op path both ways."""
    global _enabled
    _enabled = enabled


def kernel_ready(wait: bool = False) -> bool:
    """Whether the kernel is loaded and this CPU runs it; the first call starts its build (``wait``: and waits)."""
    if not _enabled or not q4.kernel_enabled() or not cpu_has_bf16():
        return False
    lib = LIBRARY.get(wait)
    return lib is not None and lib.bf16_gemm_isa() == 1


def bf16_linear(x: torch.Tensor, weight: PairedBF16, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x [..., K] @ W^T (+ bias)`` in fp32 out of bf16 products; None when the kernel cannot serve."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not kernel_ready():
        return None
    n, k = weight.shape
    return q4.gemv(x, n, k, bias, "bf16_gemm", lambda rows, out: LIBRARY.lib.bf16_gemm(
        rows.data_ptr(), rows.stride(0), weight.paired.data_ptr(), None, None, out.data_ptr(), n, rows.shape[0], n, k,
        torch.get_num_threads(), 1))
