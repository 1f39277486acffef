"""ProcessHostCollector's GPU series, with torch.cuda stood in for (no GPU on CI machines)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetllm.observability.process import ProcessHostCollector

LABELS = {"model_name": "m", "worker": "w", "role": "both", "zone": "z", "instance_type": "gpu"}


def scrape(gpu: bool) -> dict[str, list]:
    r = CollectorRegistry()
    r.register(ProcessHostCollector(LABELS, gpu=gpu))
    return {f.name: f.samples for f in text_string_to_metric_families(generate_latest(r).decode())}


def test_gpu_memory_and_utilisation_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (30 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 10 * 2**30 * (i + 1))
    monkeypatch.setattr(torch.cuda, "utilization", lambda i: 50 + i)
    fams = scrape(gpu=True)
    used = {s.labels["device"]: s.value for s in fams["fleetllm_gpu_memory_used_bytes"]}
    assert used == {"0": 50 * 2**30, "1": 50 * 2**30}
    mine = {s.labels["device"]: s.value for s in fams["fleetllm_gpu_memory_allocated_bytes"]}
    assert mine == {"0": 10 * 2**30, "1": 20 * 2**30}
    util = {s.labels["device"]: s.value for s in fams["fleetllm_gpu_utilization_ratio"]}
    assert util == {"0": 0.5, "1": 0.51}
    assert all(s.labels["zone"] == "z" for s in fams["fleetllm_gpu_memory_total_bytes"])


def test_no_utilisation_series_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (1, 2))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 0)

    def no_nvml(i: int) -> int:
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    fams = scrape(gpu=True)
    assert "fleetllm_gpu_memory_used_bytes" in fams
    assert "fleetllm_gpu_utilization_ratio" not in fams


def test_cpu_only_has_no_gpu_series() -> None:
    fams = scrape(gpu=False)
    assert not [n for n in fams if n.startswith("fleetllm_gpu_")]
    assert fams["process_resident_memory_bytes"][0].value > 0
