"""A LoRA worker's adapter metrics, with the engine's labels (``model_name`` and the worker's identity):

- ``vllm:lora_requests_info`` (vLLM's gauge, read by llm-d's LoRA-affinity scorer): one series whose labels
  ``running_lora_adapters`` / ``waiting_lora_adapters`` list the adapters of the running and waiting requests
  (comma-separated) and ``max_lora`` the resident slots; its value is the time of the scrape, as vLLM's;
- ``fleetllm:lora_requests_in_flight{lora_name}``: requests of each adapter running or waiting now (the fleet's
  autoscaler reads it: per-adapter demand, :attr:`fleetllm.fleet.autoscaler.ScalingPolicy.adapter_concurrency_per_copy`);
- ``fleetllm:lora_requests_total{lora_name}``: requests the worker ran per adapter.

The gauges are computed at scrape time from the scheduler's queues (read without a lock, as the load report is).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fleetllm.server.engine_adapters import settled

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine

IN_FLIGHT = "fleetllm:lora_requests_in_flight"


class LoraInfo(Collector):
    """``vllm:lora_requests_info`` of one engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.labels = engine.metrics.labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sched, lora = self.engine.scheduler, self.engine.lora
        running = settled(lambda: _names(list(sched.running)))
        waiting = settled(lambda: _names(list(sched.waiting)))
        fam = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (value: the time).",
                                labels=[*self.labels, "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        fam.add_metric([*self.labels.values(), running, waiting, str(lora.max_loras if lora else 0)], time.time())
        yield fam
        per = settled(lambda: collections.Counter(s.lora_name for s in [*sched.running, *sched.waiting] if s.lora_name))
        fam = GaugeMetricFamily(IN_FLIGHT, "Requests of each LoRA adapter running or waiting.",
                                labels=[*self.labels, "lora_name"])
        for name, n in sorted(per.items()):
            fam.add_metric([*self.labels.values(), name], n)
        yield fam


def _names(seqs: list) -> str:
    return ",".join(sorted({s.lora_name for s in seqs if s.lora_name is not None}))


class LoraMetrics:
    """The worker's adapter series, registered in its engine's registry (no-ops with ``--disable-metrics``)."""

    def __init__(self, engine: LLMEngine) -> None:
        m = engine.metrics
        self.enabled = m.enabled
        if not self.enabled:
            return
        m.registry.register(LoraInfo(engine))
        self._labels = m.labels
        self._requests = Counter("fleetllm:lora_requests", "Requests run with each LoRA adapter.",
                                 [*m.labels, "lora_name"], registry=m.registry)

    def request(self, lora_name: str) -> None:
        """One request run with adapter ``lora_name``."""
        if self.enabled:
            self._requests.labels(**self._labels, lora_name=lora_name).inc()
