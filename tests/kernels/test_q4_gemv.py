"""The Q4_1 kernel: weights recovered bit for bit, the GEMV equals fp32 ``F.linear`` up to float rounding.

Weights are made as the GGUF loader makes them (fp16 ``d`` and ``m``, ``d * q + m`` in fp32), over the
row counts of narrow steps (1-8, and beyond in passes), odd output widths and the scalar path's shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from fleetllm.kernels import q4


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight that is exactly a Q4_1 dequantisation, rounded as gguf's ``(d * q) + m`` in fp32."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    levels[..., 0], levels[..., 1] = 0, 15  # ggml's quantiser maps each group's min to 0 and max to 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-4).half().float()
    m = (-8 * d - torch.rand(n, k // 32, 1, generator=g) * 0.01).half().float()
    return (d * levels + m).reshape(n, k)


def test_recovery_gives_every_weight_back_bit_for_bit() -> None:
    w = q4_1_weight(64, 96)
    weight = q4.recover_q4_1(w)
    assert weight is not None and torch.equal(weight.dequantize(), w)
    assert weight.packed.shape == (64, 3, 16) and weight.packed.dtype == torch.uint8


def test_constant_groups_are_recovered() -> None:
    w = q4_1_weight(8, 64)
    w[:, :32] = 0.25  # d = 0: every level 0
    weight = q4.recover_q4_1(w)
    assert weight is not None and torch.equal(weight.dequantize(), w)


@pytest.mark.parametrize("w", [torch.randn(16, 64), torch.randn(16, 40), torch.randn(64).reshape(2, 32).double()])
def test_weights_that_are_not_q4_1_stay_fp32(w: torch.Tensor) -> None:
    assert q4.recover_q4_1(w) is None


@pytest.fixture(scope="module")
def kernel() -> None:
    if not q4.kernel_ready(wait=True):
        pytest.skip(f"C kernel unavailable: {q4.LIBRARY.error}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (577, 1536), (7, 32), (33, 96)])
def test_kernel_equals_fp32_linear_up_to_rounding(kernel: None, rows: int, n: int, k: int) -> None:
    w = q4_1_weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    out = q4.q4_linear(x, q4.recover_q4_1(w))
    ref = F.linear(x.double(), w.double())
    tol = 1e-6 * (x.double().abs() @ w.double().abs().T).max().item()  # a few ulps of the |x|·|w| sum
    assert out is not None and out.shape == (rows, n)
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("rows", [1, 2, 9])
def test_scalar_path_equals_the_vector_one_up_to_rounding(kernel: None, rows: int) -> None:
    w = q4_1_weight(33, 96)
    x = torch.randn(rows, 96)
    weight = q4.recover_q4_1(w)
    scalar, vector = q4.q4_linear(x, weight, vector=False), q4.q4_linear(x, weight)
    assert scalar is not None and vector is not None
    torch.testing.assert_close(scalar, vector, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scalar, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_kernel_takes_bias_leading_dims_and_strided_rows(kernel: None) -> None:
    w, bias = q4_1_weight(40, 64), torch.randn(40)
    x = torch.randn(2, 3, 128)[..., :64]  # rows 128 floats apart
    out = q4.q4_linear(x, q4.recover_q4_1(w), bias)
    assert out is not None and out.shape == (2, 3, 40)
    torch.testing.assert_close(out, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)


def test_without_the_kernel_the_caller_takes_its_fp32_path(kernel: None) -> None:
    weight = q4.recover_q4_1(q4_1_weight(8, 32))
    q4.set_kernel_enabled(False)
    try:
        assert q4.q4_linear(torch.randn(1, 32), weight) is None
    finally:
        q4.set_kernel_enabled(True)
    assert q4.q4_linear(torch.randn(1, 32).double(), weight) is None  # fp32 activations only
