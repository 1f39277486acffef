"""A mixture-of-experts block's narrow steps in one C call (``moe_experts.c``): router, top-k, quantised experts.

:class:`FusedExperts` holds one layer's C table (the router's fp32 weight, each expert's gate_up and down, each
Q8_0 levels and scales or :class:`Q4Weight` levels, factors and scales) and runs a step's rows through it: the chosen experts only, each read once per step
whatever number of rows chose it, their outputs weighted and summed in ascending expert order as
:class:`fleetllm.models.moe.MoE` sums them. It covers the softmax-then-top-k router without bias (Qwen2-MoE,
Qwen3-MoE, Mixtral) and SwiGLU experts without biases; GPT-OSS's router and clamped experts keep PyTorch's path.
A shared expert (Qwen2-MoE) is the caller's to add. The experts' inputs are rounded to int16 per group of 32 and
multiplied in integers (``q8_i16_rows.h``: the ``q4`` default's contract, as :func:`fleetllm.kernels.q8.q8_i16_linear`).

The library builds in the background on first use, as the Q8_0 GEMV does, under the same switch
(``FLEETLLM_Q4_KERNEL=eager``); until then, or without a compiler, :meth:`FusedExperts.__call__` returns None
and the caller takes PyTorch's path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fleetllm.kernels import q4
from fleetllm.kernels.build import KernelLibrary

P, INT = ctypes.c_void_p, ctypes.c_int


@dataclass
class Q4Weight:
    """One expert's ``[N, K]`` weight in 4 bits (:mod:`fleetllm.models.expert_quant`): levels ``q [N, K/2]`` uint8
    (0..15, two a byte as Q4_0 packs them: byte ``j`` of a group of 32 inputs holds input ``j`` low, ``j + 16``
    high), factors ``f [N, K/16]`` uint8 (``sc``, ``mn`` per group), scales ``d [N, 2 K/32/G]`` fp32 (``d``,
    ``dmin`` per super-block of ``G`` groups); the weight is ``(d * sc) * q - dmin * mn``."""

    q: torch.Tensor
    f: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        return self.q.shape[0], 2 * self.q.shape[1]

    @property
    def groups_per_scale(self) -> int:
        """``G``: groups of 32 inputs per super-block (a power of two)."""
        return self.f.shape[1] // self.d.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, bit for bit the GGUF's dequantised one."""
        from fleetllm.models.expert_quant import dequantise_q4

        return dequantise_q4(self.q, self.f, self.d)


class _Layer(ctypes.Structure):
    _fields_ = [("router", P), ("gate_up", P), ("gate_up_d", P), ("gate_up_f", P), ("gate_up_shift", INT),
                ("down", P), ("down_d", P), ("down_f", P), ("down_shift", INT), ("experts", INT), ("top_k", INT),
                ("hidden", INT), ("inter", INT), ("norm_topk", INT)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.moe_experts.argtypes = [ctypes.POINTER(_Layer), P, INT, P, P, INT, INT]
    lib.moe_experts.restype = INT
    lib.moe_experts_isa.restype = INT


LIBRARY = KernelLibrary(Path(__file__).with_name("moe_experts.c"), _declare)


def kernel_ready(wait: bool = False) -> bool:
    """Whether the C kernel is loaded and enabled; the first call starts its build (``wait``: and waits)."""
    return q4.kernel_enabled() and LIBRARY.get(wait) is not None


def _fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _served(w: Any) -> bool:
    """Whether the kernel reads weight ``w`` as it is: contiguous CPU parts of the dtypes its layout has."""
    if not isinstance(w, Q4Weight):
        return w.q.is_contiguous() and w.q.device.type == "cpu" and w.q.dtype == torch.int8 and _fp32(w.d)
    g = w.groups_per_scale
    uint8 = all(t.is_contiguous() and t.device.type == "cpu" and t.dtype == torch.uint8 for t in (w.q, w.f))
    return uint8 and _fp32(w.d) and w.f.shape[1] % w.d.shape[1] == 0 and g & (g - 1) == 0


class FusedExperts:
    """One MoE layer's C table; :meth:`of` says whether the kernel covers the layer."""

    def __init__(self, moe: Any) -> None:
        self._keep = [moe.router.weight, *(w for pair in moe.q8 for w in pair)]  # the pointers below point here
        e = moe.num_experts

        def pointers(which: int, part: str) -> int | None:
            if not hasattr(moe.q8[0][which], part):
                return None  # Q8_0: no factors (NULL tells the kernel)
            array = (P * e)(*(getattr(moe.q8[i][which], part).data_ptr() for i in range(e)))
            self._arrays.append(array)
            return ctypes.addressof(array)

        def shift(which: int) -> int:
            w = moe.q8[0][which]
            return w.groups_per_scale.bit_length() - 1 if isinstance(w, Q4Weight) else 0

        self._arrays: list[ctypes.Array] = []
        self.hidden = moe.router.weight.shape[1]
        weights = [x for w in (0, 1) for x in (pointers(w, "q"), pointers(w, "d"), pointers(w, "f"), shift(w))]
        self._layer = _Layer(moe.router.weight.data_ptr(), *weights, e, moe.top_k, self.hidden, moe.inter,
                             int(moe.norm_topk))

    @property
    def address(self) -> int:
        """The C table's address (``MoeLayer *``), for the decode stack's layer table."""
        return ctypes.addressof(self._layer)

    @classmethod
    def of(cls, moe: Any) -> FusedExperts | None:
        """The table of ``moe`` (a :class:`fleetllm.models.moe.MoE` with quantised experts), or None when the kernel
        does not cover it: another router, biases, a clamped SwiGLU, non-fp32 CPU tensors, widths that are not
        multiples of 32."""
        if moe.q8 is None or moe.router_kind != "softmax_topk" or moe.router.bias is not None:
            return None
        if moe.gate_up_bias is not None or moe.limit is not None or moe.top_k > min(moe.num_experts, 64):
            return None
        h, i = moe.router.weight.shape[1], moe.inter
        if h % 32 or i % 32 or not _fp32(moe.router.weight):
            return None
        kinds = tuple(type(w) for w in moe.q8[0])
        for pair in moe.q8:
            if pair[0].shape != (2 * i, h) or pair[1].shape != (h, i) or tuple(type(w) for w in pair) != kinds:
                return None
            if not all(_served(w) for w in pair):
                return None
        return cls(moe)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor | None = None, vector: int = 3) -> torch.Tensor | None:
        """The block's output for ``x [T, hidden]`` (fp32, CPU); ``counts`` (int64 ``[E]``) gains each expert's
        rows. None while the kernel is not loaded. ``vector`` picks the instruction set (tests): 0 the scalar path,
        2 AVX2, 3 AVX-512 VNNI where the CPU has it."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not kernel_ready():
            return None
        x = x.contiguous()
        out = torch.empty_like(x)
        status = LIBRARY.lib.moe_experts(ctypes.byref(self._layer), x.data_ptr(), x.shape[0], out.data_ptr(),
                                         None if counts is None else counts.data_ptr(), torch.get_num_threads(),
                                         int(vector))
        if status == -2:
            raise MemoryError("moe_experts: no memory for its scratch")
        if status != 0:
            raise ValueError(f"moe_experts: a step of {x.shape[0]} rows it does not take (status {status})")
        return out
