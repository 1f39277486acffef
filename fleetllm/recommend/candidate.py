"""A candidate deployment and what is predicted of it.

A candidate is one point of the search: an instance type, accelerators per replica (tensor
parallel), copies, the engine's batch and chunk limits, a weight format, speculation, the routing
policy and an optional prefill/decode split. A prediction carries an interval and says where its
numbers come from: ``measured`` (step times from a profile measured on this machine), ``modelled``
(roofline), and whether the queueing was ``simulated`` (the real scheduler in virtual time) or analytic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleetllm.recommend.catalogue import Format, Instance
from fleetllm.recommend.speculation import Speculation

LATENCY_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p90_s")


@dataclass(frozen=True)
class Candidate:
    instance: Instance
    tp: int
    fmt: Format
    replicas: int  # copies that decode (all copies without P/D)
    max_batch: int
    chunk: int  # most prompt tokens per step (max_num_batched_tokens)
    spec: Speculation = Speculation()
    routing: str = "kv_aware"
    prefill_replicas: int = 0  # > 0: disaggregated prefill/decode
    pd_threshold: int = 4096

    @property
    def gpus(self) -> int:
        return (self.replicas + self.prefill_replicas) * self.tp

    @property
    def instances(self) -> int:
        return math.ceil(self.gpus / self.instance.count)

    @property
    def price_per_hour(self) -> float:
        return self.instances * self.instance.price_per_hour

    def label(self) -> str:
        pd = f" P/D {self.prefill_replicas}:{self.replicas}@{self.pd_threshold}" if self.prefill_replicas else ""
        return (f"{self.instances}x {self.instance.name} tp{self.tp} x{self.replicas + self.prefill_replicas} "
                f"{self.fmt.name} b{self.max_batch} c{self.chunk} spec={self.spec} {self.routing}{pd}")


@dataclass
class Prediction:
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p90_s: float
    output_tps: float  # the whole fleet's output tokens/s at the given traffic
    tps_per_user: float
    utilization: float  # the busiest resource (batch slots, prefill time, KV) as a fraction of its capacity
    rel_error: float  # half-width of the interval, relative
    measured: bool  # step times measured here (else modelled by the roofline)
    queueing: str = "analytic"  # or "simulated"
    capacity_rps: float | None = None  # most requests/s that still meet the SLOs
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.utilization < 1.0 and math.isfinite(self.ttft_p90_ms)

    def interval(self, key: str) -> tuple[float, float]:
        v = getattr(self, key)
        return v * (1 - self.rel_error), v * (1 + self.rel_error)
