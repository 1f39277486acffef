"""A kernel this CPU should run and does not: one ERROR line naming it, the cause and the cost; fatal with
FLEETLLM_REQUIRE_KERNELS=1; shown as /ready's details and as fleetllm:kernel_available."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from fleetllm.engine.metrics import EngineMetrics
from fleetllm.kernels import health
from fleetllm.kernels.variants import KERNELS, expected_variant


@dataclass
class Loaded:
    """A kernel library as :func:`health.statuses` reads it."""

    variant: str | None
    error: str | None = None

    def get(self, wait: bool = False) -> None:
        return None


@pytest.fixture
def q4_int_missing(monkeypatch) -> None:
    """Every kernel loaded as this CPU runs it but q4_int_gemm, which could not be built."""
    if expected_variant("q4_int_gemm") is None:
        pytest.skip("this CPU does not run q4_int_gemm")
    libs = {name: Loaded(expected_variant(name)) for name in KERNELS}
    libs["q4_int_gemm"] = Loaded(None, "no C compiler on PATH")
    monkeypatch.setattr(health, "libraries", lambda: libs)


def test_a_missing_kernel_is_one_error_with_its_cause_and_cost(q4_int_missing, monkeypatch, caplog) -> None:
    monkeypatch.delenv(health.REQUIRE_ENV, raising=False)
    with caplog.at_level(logging.ERROR, logger="fleetllm.kernels.health"):
        found = health.check()
    assert [s.kernel for s in found if s.missing] == ["q4_int_gemm"]
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.ERROR
    assert "q4_int_gemm" in caplog.text and "no C compiler" in caplog.text and "~9x slower" in caplog.text


def test_require_kernels_makes_a_missing_kernel_fatal(q4_int_missing, monkeypatch) -> None:
    monkeypatch.setenv(health.REQUIRE_ENV, "1")
    with pytest.raises(health.KernelsMissing, match="q4_int_gemm"):
        health.check()


def test_ready_details_name_the_missing_kernel(q4_int_missing) -> None:
    details = health.details(health.statuses())
    assert details["kernels"]["q4_int_gemm"] == "missing"
    assert "no C compiler" in details["missing_kernels"]["q4_int_gemm"]


def test_metrics_show_the_missing_kernel_as_zero(q4_int_missing) -> None:
    metrics = EngineMetrics("m")
    metrics.kernels(health.statuses())

    def available(name: str) -> float | None:
        labels = {**metrics.labels, "kernel": name, "variant": expected_variant(name)}
        return metrics.registry.get_sample_value("fleetllm:kernel_available", labels)

    assert available("q4_int_gemm") == 0
    assert {available(name) for name in KERNELS if name != "q4_int_gemm" and expected_variant(name)} == {1.0}


def test_a_lesser_build_than_the_cpu_runs_counts_as_missing() -> None:
    status = health.KernelStatus("q4_int_gemm", "portable", "avx512", None, "cost")
    assert status.missing and "portable build" in status.problem()
