"""The bf16 kernel (``bf16_gemm.c``) computes in fp32 the product of x and W each rounded to bf16 (nearest even)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm.kernels import bf16


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    require_kernels(bf16.LIBRARY)


def test_paired_layout_round_trips_and_refuses_shapes_it_cannot_take() -> None:
    w = torch.randn(48, 70)
    paired = bf16.PairedBF16.of(w)
    assert paired.shape == (48, 70)
    assert torch.equal(paired.unpair(), w.bfloat16())
    assert torch.equal(paired.paired[1, 3, 5], w[16 + 5, 6:8].bfloat16())  # panel 1, pair 3, output 5
    assert bf16.PairedBF16.of(torch.randn(40, 64)) is None  # N not a multiple of 16
    assert bf16.PairedBF16.of(torch.randn(48, 63)) is None  # K odd


@pytest.mark.parametrize("n", [16, 32, 48, 80, 960])
@pytest.mark.parametrize("k", [2, 40, 576])  # below, between and at multiples of 32 (the vector rounding's width)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_product_of_the_bf16_operands_in_fp32(n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + rows)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    x[0, 0] = 1 + 2**-8  # a tie: nearest even rounds it down to 1, truncation would too, rounding up not
    x[-1, -1] = 1 + 3 * 2**-8  # a tie the other way: rounds up to 1 + 2^-6
    bias = torch.randn(n, generator=g)
    y = bf16.bf16_linear(x, bf16.PairedBF16.of(w), bias)
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    exact = xb @ wb.T + bias.double()
    scale = xb.abs() @ wb.abs().T + bias.double().abs()
    # fp32 sums of K products: within K * 2^-24 of the sum of magnitudes; a wrongly rounded x is off by ~2^-9
    assert ((y.double() - exact).abs() <= scale * k * 2**-23 + 1e-30).all()


def test_rows_read_through_their_stride_and_leading_dimensions() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 128, generator=g)[:, :, :96]  # rows 128 floats apart
    w = bf16.PairedBF16.of(torch.randn(64, 96, generator=g))
    y = bf16.bf16_linear(x, w)
    assert y.shape == (2, 5, 64)
    torch.testing.assert_close(y, bf16.bf16_linear(x.contiguous(), w), rtol=0, atol=0)


def test_switched_off_it_leaves_the_step_to_the_caller() -> None:
    w = bf16.PairedBF16.of(torch.randn(16, 32))
    bf16.set_enabled(False)
    try:
        assert bf16.bf16_linear(torch.randn(4, 32), w) is None
    finally:
        bf16.set_enabled(True)
    assert bf16.bf16_linear(torch.randn(4, 32).double(), w) is None  # fp32 activations only
