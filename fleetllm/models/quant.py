"""Weight-only int4 for CPU decode: a batch-1 step is memory-bound, so fewer weight bytes = more tok/s.

Each linear keeps its fp32 weight for wide batches (prefill, high concurrency: compute-bound, where fp32
GEMM is fastest on AVX2) and a groupwise int4 copy (group 32, asymmetric: w = (q - 8) * scale + zero,
the layout of PyTorch's ``_weight_int4pack_mm_for_cpu``) for steps of at most ``max_rows`` tokens.
Q4_1 GGUF weights are themselves groupwise-32 asymmetric int4, so the int4 copy reproduces them up to
bf16 rounding of the scales. Activations go through bf16 on that path, so outputs are close to but not
bit-identical with fp32; the default (no quantization) keeps exact fp32 numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32


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


class Int4Linear(nn.Module):
    """A linear layer with an int4 fast path for narrow batches and the fp32 weight for wide ones."""

    def __init__(self, linear: nn.Linear, max_rows: int = 8) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows = max_rows
        self.out_features = linear.out_features
        packed, sz = quantize_int4(linear.weight.detach())
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", sz, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros).float()
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """Per-output-channel int8 fast path (for the LM head, whose GGUF source is 8-bit: int4 would lose it)."""

    def __init__(self, linear: nn.Linear, max_rows: int = 8) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows = max_rows
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-8)
        self.register_buffer("qweight", (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8), persistent=False)
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).float()
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module, method: str | None, max_rows: int = 8) -> int:
    """Give the decoder's linears an int4 path and the LM head an int8 one; returns how many were swapped.

    ``method``: "none" (exact fp32) or "int4". CPU only: on CUDA bf16 GEMMs are the fast path.
    """
    if method in ("", "none", None):
        return 0
    if method != "int4":
        raise ValueError(f"unknown quantization {method!r} (choices: none, int4)")
    swapped = 0
    for layer in model.layers:
        for parent, name in ((layer.attn, "qkv"), (layer.attn, "o"), (layer.mlp, "gate_up"), (layer.mlp, "down")):
            child = getattr(parent, name)
            if isinstance(child, nn.Linear) and child.in_features % GROUP == 0 and child.weight.device.type == "cpu":
                setattr(parent, name, Int4Linear(child, max_rows))
                swapped += 1
    if isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.device.type == "cpu":
        model.lm_head = Int8Linear(model.lm_head, max_rows)
        swapped += 1
    return swapped
