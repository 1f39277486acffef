"""The Q4 x integer-activation GEMM: its blocked weight layout, and its output against the same arithmetic in
PyTorch (activations rounded per group of 32 to int16 or int8, integer dot products, fp32 zero-point term)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)
from test_quant_gemv import q4_1_weight  # this folder is on the path (pytest's prepend mode)

from fleetllm.kernels import q4, q4_int


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_kernels(q4.LIBRARY, q4_int.LIBRARY)


def weight(n: int, k: int, seed: int = 0) -> q4.Q4Weight:
    w = q4.recover_q4_1(q4_1_weight(n, k, seed))
    assert w is not None
    return w


def emulated(x: torch.Tensor, w: q4.Q4Weight, bits: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: per group, d * sx * sum(q * round(x / sx)) + m * sum(x)."""
    rows, k = x.shape
    xg = x.double().reshape(rows, k // 32, 32)
    top = 2 ** (bits - 1) - 1
    amax = xg.abs().amax(-1, keepdim=True)
    sx = (amax.float() / top).double()
    inv = torch.where(amax > 0, (top / amax.float()).double(), torch.zeros_like(amax))
    xq = torch.round((xg.float() * inv.float()).double())  # the kernel multiplies by the inverse in fp32
    dots = torch.einsum("rgi,ngi->rng", xq, w.levels().double())
    scaled = (dots * w.d.double() * sx.squeeze(-1).unsqueeze(1)).sum(-1)
    return (scaled + xg.sum(-1) @ w.m.double().T).float()


@pytest.mark.parametrize(("n", "k"), [(40, 576), (37, 1536), (8, 32), (24, 96), (16, 128), (9, 256), (5, 320)])
def test_blocked_layout_gives_the_weight_back(n: int, k: int) -> None:
    w = weight(n, k)
    blocked = q4_int.BlockedQ4.of(w)
    padded = -(-k // 128) * 4
    assert blocked.blocked.shape == (n, padded * 16) and blocked.d.shape == (n, padded)
    back = blocked.unblock()
    for name in ("packed", "d", "m"):
        assert torch.equal(getattr(back, name), getattr(w, name)), name


@pytest.fixture(params=[3, 2], ids=["vnni", "avx2"])
def isa(request: pytest.FixtureRequest) -> int:
    """Each instruction set this CPU has: VNNI where present, and AVX2's multiply-adds (capped to on any CPU)."""
    lib = q4_int.LIBRARY.lib
    if lib.q4_int_isa() < request.param:
        pytest.skip("no AVX-512 VNNI on this CPU")
    yield lib.q4_int_cap_isa(request.param)
    lib.q4_int_cap_isa(3)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize(("n", "k"), [(40, 576), (37, 1536), (8, 32), (24, 96), (16, 128), (5, 320)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 50])
def test_kernel_is_its_arithmetic(isa: int, bits: int, n: int, k: int, rows: int) -> None:
    w = weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * torch.linspace(0.1, 8, k)
    if k > 32:
        x[0, :32] = 0  # an all-zero group: scale 0
    y = q4_int.q4_int_linear(x, q4_int.BlockedQ4.of(w), bits=bits)
    ref = emulated(x, w, bits)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-5  # fp32 summation order only


def test_int16_activations_stay_within_fp32_rounding_of_the_exact_linear() -> None:
    w = weight(64, 576)
    x = torch.randn(7, 576) * 3
    x[:, 100] = 400  # an outlier channel: its groups' other inputs still get 2^15 levels
    ref = x.double() @ w.dequantize().double().T
    for bits, bound in ((16, 2e-4), (8, 5e-2)):
        y = q4_int.q4_int_linear(x, q4_int.BlockedQ4.of(w), bits=bits)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < bound, (bits, err)
    y16 = q4_int.q4_int_linear(x, q4_int.BlockedQ4.of(w), bits=16)
    y8 = q4_int.q4_int_linear(x, q4_int.BlockedQ4.of(w), bits=8)
    assert (y16.double() - ref).norm() < (y8.double() - ref).norm() / 50


def test_bias_leading_dims_and_strided_rows() -> None:
    w = weight(24, 96)
    blocked, bias = q4_int.BlockedQ4.of(w), torch.randn(24)
    x = torch.randn(2, 3, 160)[..., :96]  # rows 160 apart
    y = q4_int.q4_int_linear(x, blocked, bias)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, q4_int.q4_int_linear(x.contiguous(), blocked) + bias)


def test_widths_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="8 or 16"):
        q4_int.gemm_function(4)
    assert q4_int.q4_int_linear(torch.randn(2, 96, dtype=torch.float64), q4_int.BlockedQ4.of(weight(8, 96))) is None


def test_the_q4_switch_sends_calls_to_the_fp32_path() -> None:
    q4.set_kernel_enabled(False)
    try:
        assert q4_int.q4_int_linear(torch.randn(2, 96), q4_int.BlockedQ4.of(weight(8, 96))) is None
    finally:
        q4.set_kernel_enabled(True)


def test_scales_that_are_not_fp16_numbers_are_refused() -> None:
    w = weight(8, 64)
    odd = q4.Q4Weight(w.packed, w.d, w.m + 1e-7)  # Q4_1-shaped, but m is no fp16 number: not a GGUF's weight
    assert q4_int.BlockedQ4.of(odd) is None
