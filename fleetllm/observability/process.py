"""Process and host metrics read at scrape time, and a worker's cold-start phases.

Nothing is sampled between scrapes: CPU and memory come from psutil when ``/metrics`` is read, GPU
memory and utilisation from torch.cuda when a GPU is present. All series carry the worker's labels.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

COLD_START_PHASES = ("weight_load", "warm_up", "ready")


class ProcessHostCollector(Collector):
    """process_* (this process) and fleetllm_host_* / fleetllm_gpu_* (the machine) gauges."""

    def __init__(self, labels: dict[str, str], gpu: bool | None = None) -> None:
        self.labels = labels
        self.proc = psutil.Process()
        self.proc.cpu_percent(None)
        psutil.cpu_percent(None)  # the first call only starts the interval
        if gpu is None:
            import torch

            gpu = torch.cuda.is_available()
        self.gpu = gpu

    def _family(self, cls: type, name: str, doc: str, value: float, extra: dict[str, str] | None = None) -> Metric:
        extra = extra or {}
        fam = cls(name, doc, labels=[*self.labels, *extra])
        fam.add_metric([*self.labels.values(), *extra.values()], value)
        return fam

    def collect(self) -> Iterator[Metric]:
        g, c = GaugeMetricFamily, CounterMetricFamily
        with self.proc.oneshot():
            cpu = self.proc.cpu_times()
            yield self._family(c, "process_cpu_seconds", "CPU time of this process (user + system).", cpu.user + cpu.system)
            yield self._family(g, "process_resident_memory_bytes", "Resident memory of this process.", self.proc.memory_info().rss)
            yield self._family(g, "process_num_threads", "Threads of this process.", self.proc.num_threads())
            yield self._family(g, "process_start_time_seconds", "Process start, Unix seconds.", self.proc.create_time())
        yield self._family(g, "fleetllm_host_cpu_utilization_ratio", "Host CPU busy fraction since the last scrape.",
                           psutil.cpu_percent(None) / 100)
        yield self._family(g, "fleetllm_host_cpu_count", "Logical CPUs on the host.", psutil.cpu_count() or 0)
        vm = psutil.virtual_memory()
        yield self._family(g, "fleetllm_host_memory_used_bytes", "Host memory in use.", vm.total - vm.available)
        yield self._family(g, "fleetllm_host_memory_total_bytes", "Host memory.", vm.total)
        if self.gpu:
            yield from self._gpu()

    def _gpu(self) -> Iterator[Metric]:
        import torch

        used = GaugeMetricFamily("fleetllm_gpu_memory_used_bytes", "GPU memory in use (all processes).",
                                 labels=[*self.labels, "device"])
        total = GaugeMetricFamily("fleetllm_gpu_memory_total_bytes", "GPU memory.", labels=[*self.labels, "device"])
        mine = GaugeMetricFamily("fleetllm_gpu_memory_allocated_bytes", "GPU memory held by this process's tensors.",
                                 labels=[*self.labels, "device"])
        util = GaugeMetricFamily("fleetllm_gpu_utilization_ratio", "GPU busy fraction (NVML; absent without it).",
                                 labels=[*self.labels, "device"])
        has_util = False
        for i in range(torch.cuda.device_count()):
            key = [*self.labels.values(), str(i)]
            free, tot = torch.cuda.mem_get_info(i)
            used.add_metric(key, tot - free)
            total.add_metric(key, tot)
            mine.add_metric(key, torch.cuda.memory_allocated(i))
            try:
                util.add_metric(key, torch.cuda.utilization(i) / 100)
                has_util = True
            except Exception:  # noqa: BLE001 - NVML (pynvml) missing or unsupported: no utilisation series
                pass
        yield from (used, total, mine)
        if has_util:
            yield util


class ColdStart:
    """``fleetllm_worker_cold_start_seconds{phase}``: weight_load (read + place the weights), warm_up
    (the first request's one-off costs), ready (process start to serving, everything included); for a model
    from the store (hf://, s3://) also its phases resolve, download, verify and load (fleetllm/store/phases.py),
    and ``fleetllm_worker_model_info{root, revision}`` names the commit it serves."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._gauge = Gauge("fleetllm_worker_cold_start_seconds", "Worker start-up time by phase.",
                            [*labels, "phase"], registry=registry)
        self._labels, self._registry = labels, registry
        self._phases = {p: self._gauge.labels(**labels, phase=p) for p in COLD_START_PHASES}

    def set(self, phase: str, seconds: float) -> None:
        if phase not in self._phases:
            self._phases[phase] = self._gauge.labels(**self._labels, phase=phase)
        self._phases[phase].set(seconds)

    def model_info(self, root: str, revision: str) -> None:
        """The pinned source of the weights as labels (the revision is a commit, never a moving branch)."""
        Gauge("fleetllm_worker_model_info", "Where the served weights come from (value 1).",
              [*self._labels, "root", "revision"], registry=self._registry).labels(
            **self._labels, root=root, revision=revision).set(1)

    def ready_now(self) -> float:
        """Record 'ready' as the time since this process started; return it."""
        seconds = time.time() - psutil.Process().create_time()
        self.set("ready", seconds)
        return seconds
