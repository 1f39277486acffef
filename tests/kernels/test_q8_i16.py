"""The Q8_0 GEMV over int16 activations (``q8_i16_gemv``): the exact product of the weights and the activations
rounded per group of 32, the same bits on every instruction set and whatever the other rows."""

from __future__ import annotations

import pytest
import torch
from int16_activations import int16_rounded  # tests/ is on the path (pytest's prepend mode)
from kernel_checks import require_kernels

from fleetllm.kernels import q8


def q8_0_weight(n: int, k: int, seed: int = 0) -> q8.Q8Weight:
    """Random Q8_0 levels (-127..127) and fp16-rounded scales."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return q8.Q8Weight(levels, (torch.rand(n, k // 32, generator=g) * 0.002 + 1e-5).half().float())


@pytest.fixture(autouse=True)
def kernels() -> None:
    require_kernels(q8.LIBRARY)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize(("n", "k"), [(1027, 576), (33, 96)])
def test_it_is_the_product_of_the_weights_and_the_int16_rounded_activations(rows: int, n: int, k: int) -> None:
    weight = q8_0_weight(n, k, seed=rows)
    w = weight.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)) * 3
    out = q8.q8_i16_linear(x, weight)
    ref = int16_rounded(x) @ w.double().T
    assert out is not None and out.shape == (rows, n)
    assert (out.double() - ref).abs().max().item() < 1e-6 * (x.double().abs() @ w.double().abs().T).max().item()


def test_every_instruction_set_gives_the_same_bits() -> None:
    weight = q8_0_weight(70, 160)
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(1))
    best = q8.q8_i16_linear(x, weight)
    for level in (0, 2):  # scalar, AVX2 (on a VNNI CPU the best path is VNNI's)
        assert torch.equal(q8.q8_i16_linear(x, weight, vector=level), best)


def test_a_rows_output_does_not_depend_on_the_other_rows() -> None:
    weight = q8_0_weight(40, 64)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(2))
    batch = q8.q8_i16_linear(x, weight)
    for r in (0, 8, 10):
        assert torch.equal(q8.q8_i16_linear(x[r : r + 1], weight)[0], batch[r])


def test_a_row_with_a_non_finite_input_is_nan_and_the_others_are_not() -> None:
    weight = q8_0_weight(16, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    x[1, 40] = float("inf")
    out = q8.q8_i16_linear(x, weight)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
