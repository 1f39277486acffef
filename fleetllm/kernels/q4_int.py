"""Q4_1 weights times integer activations (``q4_int_gemm.c``): the ``q4`` linears' kernel at every step width.

On entry the activations are rounded per row and group of 32 inputs to int16 (``q4``) or int8 (``q4-q8``,
llama.cpp's Q8_0 scheme), so the weights' 4-bit levels multiply them in int32 (AVX-512 VNNI, or AVX2's
multiply-adds) and one scale per group turns the sums back into fp32; the zero-point term uses the exact
fp32 sums. Per GEMM against the Q4 kernel with fp32 activations (``benchmarks/q4_gemv.py``, SmolLM2's shapes,
2 threads): int16 1.0-1.3× at 1-48 rows (the down projection 1.5-2×), int8 2-3×. Only the rounding of x
departs from fp32: at most 1/65534 of its group's largest input in int16, where the greedy output and the
perplexity stay fp32's; in int8 1/254, which flips greedy tokens (``benchmarks/fast_path_quality.py``).

:class:`BlockedQ4` is a :class:`~fleetllm.kernels.q4.Q4Weight` with its packed bytes reordered for the
kernel (see the C source's comment); the library builds in the background on first use and, until it is
loaded or on a CPU without AVX2, :func:`q4_int_linear` returns None and the caller takes its fp32 path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from fleetllm.kernels import q4
from fleetllm.kernels.build import KernelLibrary


def _declare(lib: ctypes.CDLL) -> None:
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    for name in ("q4_i8_gemm", "q4_i16_gemm"):
        getattr(lib, name).argtypes = [p, L, p, p, p, p, L, i, i, i, i, i]
        getattr(lib, name).restype = i
    lib.q4_int_isa.restype = i
    lib.q4_int_cap_isa.argtypes = [i]
    lib.q4_int_cap_isa.restype = i


LIBRARY = KernelLibrary(Path(__file__).with_name("q4_int_gemm.c"), _declare)


@dataclass(frozen=True)
class BlockedQ4:
    """One ``[N, K]`` Q4_1 weight in the kernel's order: ``blocked [N, G * 16]`` uint8, ``d`` and ``m [N, G]``
    fp16 (the GGUF stores them so), with ``G`` the K/32 groups padded with zeros to a multiple of 4."""

    blocked: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    k: int

    @classmethod
    def of(cls, weight: q4.Q4Weight) -> BlockedQ4 | None:
        """``weight``'s packed bytes interleaved 4 at a time across blocks of 8 groups (a last block of 4); None
        when a scale is not an fp16 number (a weight that is Q4_1-shaped but not from a GGUF)."""
        n, k = weight.shape
        groups = k // q4.GROUP
        padded = (groups + 3) // 4 * 4
        d, m = torch.zeros(n, padded, dtype=torch.float16), torch.zeros(n, padded, dtype=torch.float16)
        d[:, :groups], m[:, :groups] = weight.d, weight.m
        if not (torch.equal(d[:, :groups].float(), weight.d) and torch.equal(m[:, :groups].float(), weight.m)):
            return None
        packed = torch.zeros(n, padded, 16, dtype=torch.uint8)
        packed[:, :groups] = weight.packed
        full = padded // 8
        parts = [packed[:, :8 * full].reshape(n, full, 8, 4, 4).transpose(2, 3).reshape(n, -1)]
        if padded % 8:
            parts.append(packed[:, 8 * full:].reshape(n, 1, 4, 4, 4).transpose(2, 3).reshape(n, -1))
        return cls(torch.cat(parts, dim=1).contiguous(), d, m, k)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        return self.blocked.shape[0], self.k

    def unblock(self) -> q4.Q4Weight:
        """The :class:`~fleetllm.kernels.q4.Q4Weight` this was made from."""
        n, k = self.shape
        groups, padded = k // q4.GROUP, self.d.shape[1]
        full = padded // 8
        body = self.blocked.reshape(n, padded * 16)
        parts = [body[:, :128 * full].reshape(n, full, 4, 8, 4).transpose(2, 3).reshape(n, 8 * full, 16)]
        if padded % 8:
            parts.append(body[:, 128 * full:].reshape(n, 1, 4, 4, 4).transpose(2, 3).reshape(n, 4, 16))
        packed = torch.cat(parts, dim=1)[:, :groups]
        return q4.Q4Weight(packed.contiguous(), self.d[:, :groups].float(), self.m[:, :groups].float())


def kernel_ready(wait: bool = False) -> bool:
    """Whether the kernel is loaded and this CPU runs it; the first call starts its build (``wait``: and waits).

    Off with the Q4 switch (``FLEETLLM_Q4_KERNEL=eager``, :func:`fleetllm.kernels.q4.set_kernel_enabled`).
    """
    if not q4.kernel_enabled():
        return False
    lib = LIBRARY.get(wait)
    return lib is not None and lib.q4_int_isa() > 0


def gemm_function(bits: int) -> ctypes._CFuncPtr:
    """The loaded kernel for activations of ``bits`` (8 or 16)."""
    if bits not in (8, 16):
        raise ValueError(f"activations are 8 or 16 bits, not {bits}")
    return LIBRARY.lib.q4_i8_gemm if bits == 8 else LIBRARY.lib.q4_i16_gemm


def q4_int_linear(x: torch.Tensor, weight: BlockedQ4, bias: torch.Tensor | None = None,
                  bits: int = 16) -> torch.Tensor | None:
    """``x [..., K] @ W^T (+ bias)`` through the kernel, activations rounded to ``bits`` (8 or 16); None when it
    cannot serve."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not kernel_ready():
        return None
    n, k = weight.shape
    fn = gemm_function(bits)
    return q4.gemv(x, n, k, bias, "q4_int_gemm", lambda rows, out: fn(
        rows.data_ptr(), rows.stride(0), weight.blocked.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr(),
        out.data_ptr(), n, rows.shape[0], n, k, torch.get_num_threads(), 1))
