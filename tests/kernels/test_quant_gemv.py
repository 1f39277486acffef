"""The Q4_1 and Q8_0 kernels: weights recovered bit for bit, the GEMV equals fp32 ``F.linear`` up to rounding.

Weights are made as the GGUF loader makes them (fp16 ``d`` (and ``m``), ``d * q (+ m)`` in fp32, ggml's
quantiser putting each group's extremes at the end levels), over the row counts of narrow steps (1-8, and
beyond in passes), output widths that are not multiples of 8 and the scalar path. Both kernels answer the
same calls, so every kernel check runs over both formats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)
from torch.nn import functional as F  # noqa: N812

from fleetllm.kernels import q4, q8


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight that is exactly a Q4_1 dequantisation, rounded as gguf's ``(d * q) + m`` in fp32."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    levels[..., 0], levels[..., 1] = 0, 15  # ggml's quantiser maps each group's min to 0 and max to 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-4).half().float()
    m = (-8 * d - torch.rand(n, k // 32, 1, generator=g) * 0.01).half().float()
    return (d * levels + m).reshape(n, k)


def q8_0_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight that is exactly a Q8_0 dequantisation, rounded as gguf's ``d * q`` in fp32."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    levels[..., 0] = torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -127.0, 127.0)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.002 + 1e-5).half().float()
    return (d * levels).reshape(n, k)


@dataclass(frozen=True)
class Format:
    """One kernel's way in: a weight maker, its exact recovery and its linear."""

    name: str
    weight: Callable[..., torch.Tensor]
    recover: Callable[[torch.Tensor], Any]
    recover_eager: Callable[[torch.Tensor], Any]
    linear: Callable[..., torch.Tensor | None]
    ready: Callable[[bool], bool]
    library: Any


Q4 = Format("q4_1", q4_1_weight, q4.recover_q4_1, q4.recover_q4_1_eager, q4.q4_linear, q4.kernel_ready, q4.LIBRARY)
Q8 = Format("q8_0", q8_0_weight, q8.recover_q8_0, q8.recover_q8_0_eager, q8.q8_linear, q8.kernel_ready, q8.LIBRARY)
FORMATS = pytest.mark.parametrize("fmt", [Q4, Q8], ids=lambda f: f.name)


# ---- recovery ------------------------------------------------------------------------------------------
def test_q4_1_recovery_gives_every_weight_back_bit_for_bit() -> None:
    w = q4_1_weight(64, 96)
    weight = q4.recover_q4_1(w)
    assert weight is not None and torch.equal(weight.dequantize(), w)
    assert weight.packed.shape == (64, 3, 16) and weight.packed.dtype == torch.uint8


def test_q4_1_constant_groups_are_recovered() -> None:
    w = q4_1_weight(8, 64)
    w[:, :32] = 0.25  # d = 0: every level 0
    weight = q4.recover_q4_1(w)
    assert weight is not None and torch.equal(weight.dequantize(), w)


@pytest.mark.parametrize("w", [torch.randn(16, 64), torch.randn(16, 40), torch.randn(64).reshape(2, 32).double()])
def test_weights_that_are_not_q4_1_stay_fp32(w: torch.Tensor) -> None:
    assert q4.recover_q4_1(w) is None


def test_q8_0_recovery_gives_every_weight_back_bit_for_bit() -> None:
    w = q8_0_weight(64, 96)
    weight = q8.recover_q8_0(w)
    assert weight is not None and torch.equal(weight.dequantize(), w)
    assert weight.q.shape == (64, 96) and weight.q.dtype == torch.int8 and weight.d.shape == (64, 3)


def test_q8_0_zero_groups_are_recovered() -> None:
    w = q8_0_weight(8, 64)
    w[:, :32] = 0  # d = 0
    weight = q8.recover_q8_0(w)
    assert weight is not None and torch.equal(weight.dequantize(), w) and (weight.d[:, 0] == 0).all()


@pytest.mark.parametrize("w", [torch.randn(16, 64), torch.randn(16, 40), q8_0_weight(4, 64).double()])
def test_weights_that_are_not_q8_0_stay_fp32(w: torch.Tensor) -> None:
    assert q8.recover_q8_0(w) is None


def test_a_q4_1_weight_is_not_taken_for_q8_0() -> None:
    levels = torch.randint(0, 16, (8, 2, 32)).float()
    levels[..., 0], levels[..., 1] = 0, 15
    w = ((levels * 0.013).half().float() - 0.1).reshape(8, 64)  # a nonzero minimum: not d * q
    assert q8.recover_q8_0(w) is None


def _nudged(w: torch.Tensor) -> torch.Tensor:
    """``w`` with one weight moved by one ulp: no longer a dequantisation."""
    w = w.clone()
    w[3, 40] = torch.nextafter(w[3, 40], torch.tensor(1.0))
    return w


def _with(w: torch.Tensor, value: float) -> torch.Tensor:
    w = w.clone()
    w[1, 7] = value
    return w


@FORMATS
@pytest.mark.parametrize("case", ["exact", "random", "nudged", "nan", "inf", "zeros", "huge"])
def test_c_recovery_is_the_eager_one_bit_for_bit(fmt: Format, case: str) -> None:
    require_kernels(fmt.library)
    exact = fmt.weight(48, 96, seed=3)
    w = {"exact": exact, "random": torch.randn(48, 96), "nudged": _nudged(exact), "nan": _with(exact, float("nan")),
         "inf": _with(exact, float("inf")), "zeros": torch.zeros(48, 96), "huge": exact * 1e9}[case]
    c, eager = fmt.recover(w), fmt.recover_eager(w)
    assert (c is None) == (eager is None)
    assert (c is not None) == (case in ("exact", "zeros"))
    if c is not None:
        for name in c.__dataclass_fields__:
            assert torch.equal(getattr(c, name), getattr(eager, name)), name


# ---- the kernels -----------------------------------------------------------------------------------------
@pytest.fixture
def kernel(fmt: Format) -> Format:
    require_kernels(fmt.library)
    return fmt


@FORMATS
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (1027, 576), (577, 1536), (7, 32), (33, 96)])
def test_kernel_equals_fp32_linear_up_to_rounding(kernel: Format, rows: int, n: int, k: int) -> None:
    w = kernel.weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    out = kernel.linear(x, kernel.recover(w))
    ref = F.linear(x.double(), w.double())
    tol = 1e-6 * (x.double().abs() @ w.double().abs().T).max().item()  # a few ulps of the |x|·|w| sum
    assert out is not None and out.shape == (rows, n)
    assert (out.double() - ref).abs().max().item() < tol


@FORMATS
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_scalar_path_equals_the_vector_one_up_to_rounding(kernel: Format, rows: int) -> None:
    w = kernel.weight(33, 96)
    x = torch.randn(rows, 96)
    weight = kernel.recover(w)
    scalar, vector = kernel.linear(x, weight, vector=False), kernel.linear(x, weight)
    assert scalar is not None and vector is not None
    torch.testing.assert_close(scalar, vector, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scalar, F.linear(x, w), atol=1e-5, rtol=1e-5)


@FORMATS
def test_kernel_takes_bias_leading_dims_and_strided_rows(kernel: Format) -> None:
    w, bias = kernel.weight(40, 64), torch.randn(40)
    x = torch.randn(2, 3, 128)[..., :64]  # rows 128 floats apart
    out = kernel.linear(x, kernel.recover(w), bias)
    assert out is not None and out.shape == (2, 3, 40)
    torch.testing.assert_close(out, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)


@FORMATS
def test_the_q4_switch_sends_calls_to_the_fp32_path(kernel: Format) -> None:
    weight = kernel.recover(kernel.weight(8, 32))
    q4.set_kernel_enabled(False)
    try:
        assert kernel.linear(torch.randn(1, 32), weight) is None
    finally:
        q4.set_kernel_enabled(True)
    assert kernel.linear(torch.randn(1, 32).double(), weight) is None  # fp32 activations only


@pytest.mark.parametrize(("status", "error"), [(-1, ValueError), (-2, MemoryError)])
def test_a_kernels_status_names_what_went_wrong(status: int, error: type[Exception]) -> None:
    from fleetllm.kernels.q4 import gemv

    with pytest.raises(error, match="status -1" if status == -1 else "no memory"):
        gemv(torch.zeros(2, 64), 16, 64, None, "q4_gemv", lambda rows, out: status)
