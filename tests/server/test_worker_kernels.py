"""A worker on the CPU says which C kernels it runs: in /ready's details and as fleetllm:kernel_available."""

from __future__ import annotations

import httpx

from fleetllm.kernels.variants import KERNELS, expected_variant


def test_ready_lists_the_kernels_this_cpu_runs(worker) -> None:
    body = httpx.get(worker.url + "/ready", timeout=10).json()
    expected = {name: v for name in KERNELS if (v := expected_variant(name)) is not None}
    assert body["status"] == "ready" and body["kernels"] == expected and "missing_kernels" not in body


def test_metrics_count_each_kernel_available(worker) -> None:
    expected = [name for name in KERNELS if expected_variant(name) is not None]
    assert worker.metrics()["fleetllm:kernel_available"] == len(expected)
