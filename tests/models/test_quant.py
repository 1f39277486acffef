"""The int4/int8 decode path stays close to fp32 and only serves narrow batches."""

from __future__ import annotations

import torch
from torch import nn

from fleetllm.models.quant import Int4Linear, Int8Linear, quantize_int4


def test_int4_reproduces_a_groupwise_int4_weight_up_to_bf16_rounding() -> None:
    torch.manual_seed(0)
    levels = torch.randint(0, 16, (64, 128)).float()
    levels[:, ::32], levels[:, 1::32] = 0, 15  # every group spans the full int4 range
    scale = torch.rand(64, 4).repeat_interleave(32, dim=1) * 0.1 + 0.01
    w = levels * scale - 0.3  # exactly representable as asymmetric int4 per group of 32
    lin = nn.Linear(128, 64, bias=False)
    lin.weight.data = w
    x = torch.randn(3, 128).bfloat16().float()  # the int4 path feeds bf16 activations
    ref = x @ w.T
    out = Int4Linear(lin)(x)
    assert ((out - ref).norm() / ref.norm()).item() < 0.05  # bf16 scales/zeros: a few percent


def test_wide_batches_take_the_exact_fp32_path() -> None:
    lin = nn.Linear(64, 32, bias=True)
    x = torch.randn(9, 64)
    assert torch.equal(Int4Linear(lin, max_rows=8)(x), lin(x))
    assert torch.equal(Int8Linear(lin, max_rows=8)(x), lin(x))


def test_int8_head_is_close_to_fp32() -> None:
    lin = nn.Linear(96, 500, bias=False)
    x = torch.randn(2, 96)
    ref = lin(x)
    assert ((Int8Linear(lin)(x) - ref).norm() / ref.norm()).item() < 0.02


def test_scales_and_zeros_layout() -> None:
    packed, sz = quantize_int4(torch.randn(64, 96))
    assert sz.shape == (3, 64, 2) and sz.dtype == torch.bfloat16
