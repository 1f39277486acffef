"""Quantised weights for CPU steps, one kernel per regime: int4 for narrow steps, int8 GEMMs for wide ones.

A narrow step (fewer than ``WIDE_ROWS`` tokens: decode at low concurrency) is memory-bound, so fewer
weight bytes = more tok/s: the decoder's linears use groupwise int4 (group 32, asymmetric: w = (q - 8) *
scale + zero, the layout of PyTorch's ``_weight_int4pack_mm_for_cpu``; Q4_1 GGUF weights are themselves
groupwise-32 asymmetric int4, so this reproduces them up to bf16 rounding of the scales) and the LM head
weight-only int8 (its GGUF source is 8-bit: int4 would lose it). A wide step (prefill, high concurrency)
is compute-bound, and on AVX2 without AVX-512/VNNI the fastest GEMM measured is fbgemm's int8 one with
per-channel int8 weights and per-token int8 activations (about 1.5-4× fp32; bf16 and weight-only kernels
are slower than fp32 there: ``benchmarks/quant_kernels.py``). ``int4`` keeps exact fp32 for wide steps;
``int4-int8`` takes the int8 GEMM there and holds no fp32 decoder weights, but fails the quality bar
(greedy agreement with fp32 on 1 of 16 reference prompts at wide steps: 7-bit per-token activations lose
the outlier channels; ``benchmarks/fast_path_quality.py``). ``none`` keeps exact fp32.

``q4`` keeps the Q4_1 GGUF weights as they are (:mod:`fleetllm.kernels.q4`: 4-bit levels and fp32 scales
recovered exactly from the fp32 weights) and runs the narrow steps of those linears through a C GEMM that
rounds the activations to int16 per group of 32 and multiplies them with the levels in integer dot products
(:mod:`fleetllm.kernels.q4_int`): greedy output and perplexity as fp32's. Wide steps are compute-bound, and
there, on a CPU with AVX-512 BF16, the same weights rounded to bf16 take them from ``BF16_ROWS`` rows
(:mod:`fleetllm.kernels.bf16`: 1.5-2.6× the int16 GEMM, greedy output equal to fp32's on 14-15 of 16 prompts,
perplexity within 0.01%); without it fp32 ``F.linear`` takes them from ``INT16_WIDE_ROWS``. ``q4-q8`` rounds
the activations to int8 at every width instead (llama.cpp's arithmetic): 2-3× the int16 GEMM's speed at narrow
steps, but greedy output agrees with fp32 on only about 3 of 16 prompts (``benchmarks/fast_path_quality.py``).
The LM head, Q8_0 in the GGUF, gets the exact Q8_0 GEMV with fp32 activations for narrow steps
(:mod:`fleetllm.kernels.q8`) and the bf16 kernel (else fp32 from ``Q4_WIDE_ROWS``) for wide ones; linears
that are neither Q4_1 nor Q8_0 stay fp32. Linears a Q8_0 GGUF kept as Q8_0 at load (its attention, a mixture of
experts' tied head: :mod:`fleetllm.models.q8_weights`) and its experts take the Q8_0 GEMV below ``Q4_WIDE_ROWS``
rows with activations rounded to int16 per group of 32, as the Q4_1 linears' (``q8_i16_gemv``, ``moe_experts.c``),
and their weight dequantised per product from there, with no fp32 or bf16 copy.

:func:`quantize_model` never changes the model it is given: it returns a copy sharing the embeddings and
norms, cached per (model, method), so engines over one set of loaded weights can differ in quantisation.
"""

from __future__ import annotations

import copy
import warnings
import weakref

import torch
from torch import nn

from fleetllm.kernels import bf16, q8
from fleetllm.kernels.decode_stack import MAX_CHUNK_KEYS, DecodeStack
from fleetllm.kernels.q4 import recover_q4_1
from fleetllm.kernels.q4_int import BlockedQ4, kernel_ready, q4_int_linear
from fleetllm.models.llama import MLP
from fleetllm.models.moe import MoE
from fleetllm.models.q8_weights import PackedQ8Linear

GROUP = 32
WIDE_ROWS = 8  # steps of at least this many tokens take the int8 GEMM (issue #19: "int8 for batch ≥ 8")
# Under "q4" (and "q4-q8") without AVX-512 BF16, the Q8_0 LM head's GEMV takes steps of fewer rows than this; it loses
# to fp32 ``F.linear`` from ~64 rows (git log -p BENCHMARKS.md: "q4 as the default")
Q4_WIDE_ROWS = 48
# "q4"'s Q4_1 linears take fp32 ``F.linear`` from here: per step of SmolLM2's decoder linears int16 activations are
# 1.3-1.5x fp32 at 48-96 rows, 1.06x at 192-256 and lose at 512 (0.67-0.98x per shape); int8 wins at every width
# measured (up to 2,048 rows), so "q4-q8" has no bound (``benchmarks/q4_gemv.py``)
INT16_WIDE_ROWS = 256
# The decode stack (fleetllm/kernels/decode_stack.py) takes decode steps of fewer rows than this, its GEMMs those of
# the linears at the step's width: at 48 and 64 rows it is 1.28x and 1.22x the op-by-op step (its attention and
# element-wise work; ``benchmarks/engine_step.py``); from here the op-by-op step's fp32 GEMMs are faster than int16
STACK_ROWS = INT16_WIDE_ROWS
# With AVX-512 BF16, "q4"'s Q4_1 linears and its Q8_0 head take the bf16 kernel from here. Per GEMM it wins from 4
# rows (decoder linears 1.05x the int16 Q4 kernel at 4 rows, 1.5x at 8, 2x at 32-64, 2.6x at 256-512:
# ``benchmarks/q4_gemv.py``), but a whole decode-stack step, whose 270 MB of bf16 weights stream from memory against
# the Q4 ones' 100 MB, is slower at 4-5 rows (10.2 vs 8.4 ms at 4), even at 6 (12.0-14.2 vs 13.1-13.6) and faster
# from 7 (12.7-13.0 vs 15.7-16.2; 13.4 vs 18.2 at 8); at a tie int16 keeps the finer rounding
BF16_ROWS = 7
METHODS = ("none", "int4", "int4-int8", "q4", "q4-q8")
ACTIVATION_BITS = {"q4": 16, "q4-q8": 8}
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = weakref.WeakKeyDictionary()
# a quantised copy -> its method and its model (weakly: the model's _CACHE entry holds the copy)
_MADE: weakref.WeakKeyDictionary[nn.Module, tuple[str, weakref.ref[nn.Module]]] = weakref.WeakKeyDictionary()


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric groupwise int4 of ``w [N, K]``: (packed weight, scales-and-zeros ``[K/group, N, 2]`` bf16)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    zeros = lo + 8 * scale
    sz = torch.stack([scale.t(), zeros.t()], dim=-1).contiguous().to(torch.bfloat16)
    return packed, sz


def _channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``w [N, K]``: (int8 weight, fp32 scale ``[N]``)."""
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-8)
    return (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8), scale


class Int4Linear(nn.Module):
    """Groupwise int4 weights, bf16 activations (PyTorch's int4 CPU kernel)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.bias = linear.bias
        packed, sz = quantize_int4(linear.weight.detach())
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", sz, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros).float()
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """Per-output-channel int8 weights, bf16 activations (weight-only: for memory-bound steps)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.bias = linear.bias
        qweight, scale = _channel_int8(linear.weight.detach().float())
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).float()
        return y if self.bias is None else y + self.bias


class Int8DynamicLinear(nn.Module):
    """Per-output-channel int8 weights and per-token int8 activations, through fbgemm's int8 GEMM.

    fbgemm quantises the activations per tensor; dividing each row by its own absolute maximum first
    (and multiplying the output back) makes that per token: one row's outlier does not coarsen the
    others' resolution. ``reduce_range``: 7-bit activations, as fbgemm needs on CPUs without VNNI,
    where products of 8-bit pairs can saturate its int16 accumulation.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        qweight, scale = _channel_int8(linear.weight.detach().float())
        zeros = torch.zeros_like(scale, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, but fbgemm's packing still takes one
            warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zeros, 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)  # the bias is added after rescaling
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        y = torch.ops.quantized.linear_dynamic(x / amax, self.packed, True) * amax
        return y if self.bias is None else y + self.bias


class KernelLinear(nn.Module):
    """One linear through a C kernel (:meth:`kernel`), and through the fp32 ``linear`` while the kernel is not
    built or where it cannot run (no compiler, an instruction set the CPU lacks, its switch off)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ W^T (+ bias)`` through the kernel, or None when it cannot serve now."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x)
        return self.linear(x) if y is None else y


class Q4Linear(KernelLinear):
    """Exact Q4_1 weights times activations rounded to ``bits`` (``q4_int_gemm.c``)."""

    def __init__(self, linear: nn.Linear, weight: BlockedQ4, bits: int) -> None:
        super().__init__(linear)
        self.q4, self.bits = weight, bits
        kernel_ready()  # starts the kernel's background build

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        return q4_int_linear(x, self.q4, self.linear.bias, self.bits)


class BF16Linear(KernelLinear):
    """The weight rounded to bf16, times activations rounded to bf16, in fp32 (``bf16_gemm.c``: AVX-512 BF16)."""

    def __init__(self, linear: nn.Linear, weight: bf16.PairedBF16) -> None:
        super().__init__(linear)
        self.w16 = weight
        bf16.kernel_ready()  # starts the kernel's background build

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        return bf16.bf16_linear(x, self.w16, self.linear.bias)


class Q8Linear(KernelLinear):
    """Exact Q8_0 weights, fp32 activations (``q8_gemv.c``)."""

    def __init__(self, linear: nn.Linear, weight: q8.Q8Weight) -> None:
        super().__init__(linear)
        self.q8 = weight
        q8.kernel_ready()  # starts the kernel's background build

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        return q8.q8_linear(x, self.q8, self.linear.bias)


class ByWidth(nn.Module):
    """One linear layer with a kernel per regime: ``narrow`` below ``rows`` rows, ``wide`` from there.

    ``weight``: the fp32 weight, for what reads ``.weight`` through the quantised copy (EAGLE drafters slice the
    LM head's, which, tied, is the embedding table anyway); shared with the model under "int4" and "q4", None
    under "int4-int8", which keeps no fp32 decoder weights.
    """

    def __init__(self, narrow: nn.Module, wide: nn.Module, weight: torch.Tensor | None = None,
                 rows: int = WIDE_ROWS) -> None:
        super().__init__()
        self.narrow, self.wide, self.weight, self.rows = narrow, wide, weight, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x) if x.shape[0] >= self.rows else self.narrow(x)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy whose children can be replaced without touching ``module`` (parameters stay shared)."""
    c = copy.copy(module)
    c._modules = dict(module._modules)
    c._parameters = dict(module._parameters)
    c._buffers = dict(module._buffers)
    return c


def _wide(linear: nn.Linear, fp32_rows: int) -> tuple[nn.Module, int]:
    """The kernel of ``linear``'s wide steps under "q4", and the rows from which it takes them: bf16 from
    ``BF16_ROWS`` on a CPU with AVX-512 BF16, else ``linear`` itself (fp32) from ``fp32_rows``."""
    paired = bf16.PairedBF16.of(linear.weight) if bf16.cpu_has_bf16() else None
    return (linear, fp32_rows) if paired is None else (BF16Linear(linear, paired), BF16_ROWS)


def _q4_or_fp32(linear: nn.Linear, bits: int, invariant: bool) -> nn.Module:
    """``linear`` through the Q4 kernel when its weight is exactly Q4_1 (int16 activations: narrow steps, see
    :func:`_wide`; int8, or ``invariant``: every step), else ``linear`` itself."""
    weight = recover_q4_1(linear.weight)
    blocked = None if weight is None else BlockedQ4.of(weight)
    if blocked is None:
        return linear
    q = Q4Linear(linear, blocked, bits)
    if bits == 8 or invariant:
        return q
    wide, rows = _wide(linear, INT16_WIDE_ROWS)
    return ByWidth(q, wide, linear.weight, rows)


def _q4_head(head: nn.Linear, bits: int, invariant: bool) -> nn.Module:
    """The LM head under "q4": the Q8_0 kernel for narrow steps (``invariant``: every step) when its weight is
    exactly Q8_0 (the GGUF's tied head is), else exactly Q4_1 or fp32 as a decoder linear. The fp32 weight stays
    shared (tied embedding)."""
    if isinstance(head, PackedQ8Linear):
        return _packed_q8(head, invariant)
    weight = q8.recover_q8_0(head.weight)
    if weight is None:
        return _q4_or_fp32(head, bits, invariant)
    if invariant:
        return Q8Linear(head, weight)
    # fp32 wide steps take over from Q4_WIDE_ROWS: the Q8_0 GEMV loses to them from ~64 rows
    wide, rows = _wide(head, Q4_WIDE_ROWS) if bits == 16 else (head, Q4_WIDE_ROWS)
    return ByWidth(Q8Linear(head, weight), wide, head.weight, rows)


def _packed_q8(linear: PackedQ8Linear, invariant: bool) -> nn.Module:
    """A linear kept as Q8_0 at load (a Q8_0 GGUF's attention, embedding-tied head) with its narrow steps on the
    Q8_0 GEMV, below ``Q4_WIDE_ROWS`` rows (``invariant``: every step), as a Q8_0 LM head's; wider ones multiply
    by the weight dequantised per product. No fp32 or bf16 copy is made: keeping the file's size in memory is
    the point."""
    q = _shallow(linear)
    q.q8_rows = (1 << 62) if invariant else Q4_WIDE_ROWS
    q8.kernel_ready()  # starts the kernel's background build
    return q


def _decoder_linear(linear: nn.Linear, method: str, invariant: bool) -> nn.Module:
    if isinstance(linear, PackedQ8Linear) and method in ACTIVATION_BITS:
        return _packed_q8(linear, invariant)
    if method in ACTIVATION_BITS:
        return _q4_or_fp32(linear, ACTIVATION_BITS[method], invariant)
    narrow = Int4Linear(linear) if linear.in_features % GROUP == 0 else Int8Linear(linear)
    if method == "int4":  # wide steps keep the exact fp32 weight (and GEMM)
        return ByWidth(narrow, linear, linear.weight)
    return ByWidth(narrow, Int8DynamicLinear(linear))


def _q8_experts(moe: MoE, invariant: bool) -> MoE:
    """``moe`` whose steps of fewer than ``INT16_WIDE_ROWS`` tokens (``invariant``: every step) take the experts
    kernel (int16 activations) when every expert weight is exactly Q8_0 (a Q8_0 GGUF's ``*_exps``), wider ones fp32
    ``F.linear`` over each expert's dequantised weight; otherwise ``moe`` itself. The bound is the int16 GEMM's:
    on the realistic shape (one layer, one thread) the kernel took 19 / 53 / 176 ms at 48 / 128 / 256 tokens
    against 88 / 142 / 226 ms op by op (a prompt's prefill: every expert dequantised for its product)."""
    weights = moe.q8 or []  # kept quantised at load (a Q8_0 GGUF's experts), else recovered here
    for e in range(len(weights), moe.num_experts):
        pair = (q8.recover_q8_0(moe.gate_up[e]), q8.recover_q8_0(moe.down[e]))
        if pair[0] is None or pair[1] is None:
            return moe
        weights.append(pair)
    q = _shallow(moe)
    q.q8, q.q8_rows = weights, (1 << 62) if invariant else INT16_WIDE_ROWS
    q8.kernel_ready()  # starts the kernel's background build
    return q


def quantize_model(model: nn.Module, method: str | None, batch_invariant: bool = False) -> nn.Module:
    """``model`` with quantised linears for ``method``: "none", ``model`` itself; "int4", int4 (LM head:
    int8) narrow steps and exact fp32 wide ones; "int4-int8", int8 GEMMs for wide steps too, no fp32 copy;
    "q4", the Q4_1 kernel (int16 activations) for the Q4_1 linears' narrow steps and bf16 (or fp32) for wide
    ones, the Q8_0 one for a Q8_0 LM head's narrow steps, fp32 elsewhere; "q4-q8", int8 activations at every
    width. ``batch_invariant``: "q4" takes its narrow kernels at every width too (see the module doc); refused
    with "int4" and "int4-int8".

    CPU only: on CUDA bf16 GEMMs are the fast path, and the model is returned unchanged.
    """
    if batch_invariant and method in ("int4", "int4-int8"):
        raise ValueError(f"batch_invariant is not implemented for quantization {method!r} (none, q4 or q4-q8)")
    key = f"{method}, batch-invariant" if batch_invariant and method in ACTIVATION_BITS else method
    if model in _MADE:  # a quantised copy, e.g. an engine's shared through ``loaded``
        made, base = _MADE[model][0], _MADE[model][1]()
        if key == made:
            return model
        if base is None:
            raise ValueError(f"this model was quantised as {made!r} and its unquantised form is gone")
        model = base
    if method in ("", "none", None) or model.norm.weight.device.type != "cpu":
        return model
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r} (choices: {', '.join(METHODS)})")
    cached = _CACHE.setdefault(model, {})
    if key not in cached:
        cached[key] = _quantized_copy(model, method, batch_invariant)
        _MADE[cached[key]] = (key, weakref.ref(model))
    return cached[key]


def _quantized_copy(model: nn.Module, method: str, invariant: bool) -> nn.Module:
    q = _shallow(model)
    q.layers = nn.ModuleList(_shallow(layer) for layer in model.layers)
    for layer in q.layers:
        layer.attn = _shallow(layer.attn)
        linears = [(layer.attn, "qkv"), (layer.attn, "o")]
        if isinstance(layer.mlp, MLP):
            layer.mlp = _shallow(layer.mlp)
            linears += [(layer.mlp, "gate_up"), (layer.mlp, "down")]
        elif method in ACTIVATION_BITS:
            layer.mlp = _q8_experts(layer.mlp, invariant)
        for parent, name in linears:
            setattr(parent, name, _decoder_linear(getattr(parent, name), method, invariant))
    head = model.lm_head
    if method in ACTIVATION_BITS:
        q.lm_head = _q4_head(head, ACTIVATION_BITS[method], invariant)
        q.decode_stack = DecodeStack.build(q, STACK_ROWS)  # None where it does not cover the model
        if invariant and q.decode_stack is not None:
            for layer in q.layers:
                layer.attn.in_place_chunk_keys = MAX_CHUNK_KEYS
    else:
        q.lm_head = ByWidth(Int8Linear(head), head if method == "int4" else Int8DynamicLinear(head), head.weight)
    return q
