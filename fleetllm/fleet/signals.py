"""A model's load signals for the autoscaler, read from its copies' ``/metrics`` pages.

Gauges are read as they are now (waiting requests summed, KV usage averaged over copies); rates and
percentiles come from the difference between two reads ``dt`` seconds apart: request rate from
``vllm:request_success``, TTFT and ITL p90 from the histogram buckets, interpolated within a bucket as
Prometheus' ``histogram_quantile`` does, and the mean concurrency over the interval by Little's law: the
seconds requests spent in the system (``vllm:e2e_request_latency_seconds_sum``) per second. The running
gauge, read at one instant, swings several-fold at a steady load; the mean does not. A LoRA worker's requests in
flight per adapter (``fleetllm:lora_requests_in_flight{lora_name}``) are summed over copies by adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from fleetllm.fleet.autoscaler import Signals

TTFT = "vllm:time_to_first_token_seconds"
MIN_SAMPLES = 10  # fewer observations in the window give no percentile: one slow request is no trend
ITL = "vllm:inter_token_latency_seconds"
ADAPTER_IN_FLIGHT = "fleetllm:lora_requests_in_flight"  # a LoRA worker's, by lora_name (fleetllm/server/lora_metrics.py)


class Page:
    """One ``/metrics`` page: sample values summed over labels, each histogram's cumulative buckets, and the
    requests in flight per LoRA adapter."""

    def __init__(self, text: str) -> None:
        self.values: dict[str, float] = {}
        self.buckets: dict[str, dict[float, float]] = {}
        self.adapters: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == ADAPTER_IN_FLIGHT:
                    self.adapters[s.labels["lora_name"]] = self.adapters.get(s.labels["lora_name"], 0.0) + s.value
                elif s.name.endswith("_bucket"):
                    b = self.buckets.setdefault(s.name[: -len("_bucket")], {})
                    le = float(s.labels["le"])
                    b[le] = b.get(le, 0.0) + s.value
                else:
                    self.values[s.name] = self.values.get(s.name, 0.0) + s.value


def quantile(q: float, buckets: Mapping[float, float], min_count: float = 1) -> float | None:
    """The ``q`` quantile of cumulative ``{upper bound: count}`` buckets (None below ``min_count`` observations)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] < max(min_count, 1e-9):
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower  # beyond the last finite bound: its lower edge, as Prometheus answers
            width = buckets[le] - below
            return lower + (le - lower) * ((rank - below) / width if width else 1.0)
        lower, below = le, buckets[le]
    return lower


def model_signals(before: Mapping[str, str], after: Mapping[str, str], dt: float, held: int = 0) -> Signals:
    """Signals of one model from its copies' pages (``{copy url: text}``) read ``dt`` seconds apart.

    Copies missing from ``before`` (just started) count for gauges only."""
    pages = {u: Page(t) for u, t in after.items()}
    old = {u: Page(t) for u, t in before.items() if u in pages}
    n = len(pages)
    if n == 0:
        return Signals(copies=0, held=held)

    def delta_buckets(name: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for u, p in pages.items():
            prev = old[u].buckets.get(name, {}) if u in old else None
            if prev is None:
                continue
            for le, c in p.buckets.get(name, {}).items():
                out[le] = out.get(le, 0.0) + c - prev.get(le, 0.0)
        return out

    def delta(name: str) -> float:
        return sum(p.values.get(name, 0.0) - old[u].values.get(name, 0.0) for u, p in pages.items() if u in old)

    finished = delta("vllm:request_success_total")
    busy_s = delta("vllm:e2e_request_latency_seconds_sum")
    return Signals(
        copies=n,
        waiting=sum(p.values.get("vllm:num_requests_waiting", 0.0) for p in pages.values()),
        running=sum(p.values.get("vllm:num_requests_running", 0.0) for p in pages.values()),
        held=held,
        kv_usage=sum(p.values.get("vllm:kv_cache_usage_perc", 0.0) for p in pages.values()) / n,
        ttft_p90_s=quantile(0.9, delta_buckets(TTFT), MIN_SAMPLES),
        itl_p90_s=quantile(0.9, delta_buckets(ITL), MIN_SAMPLES),
        request_rate=finished / dt if dt > 0 else 0.0,
        concurrency=busy_s / dt if old and dt > 0 else None,
        adapters=_summed(p.adapters for p in pages.values()),
    )


def _summed(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out
