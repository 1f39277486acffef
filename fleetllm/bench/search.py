"""Measuring load points: single points, sweeps over lists, and the SLO search.

``find_max_load`` doubles the load from a start value until a point misses the SLOs (or the
server is over-saturated: doubling the load bought < 5% more throughput while median TTFT more than
doubled), then bisects between the last passing and the first failing measured point. It assumes
SLO attainment is monotone in load, which holds for latency SLOs away from noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fleetllm.bench import server_metrics
from fleetllm.bench.agent import agent_summary
from fleetllm.bench.client import ClientConfig, RequestRecord
from fleetllm.bench.load import LoadConfig, RunResult, run_load
from fleetllm.bench.metrics import SloLimit, summarize
from fleetllm.bench.report import run_entry
from fleetllm.bench.workloads import Workload

SATURATION_GAIN = 1.05
SATURATION_TTFT_GROWTH = 2.0


@dataclass
class Measurer:
    """Runs one load point: scrape /metrics, run, scrape again, summarize."""

    client: ClientConfig
    workload: Workload
    slos: list[SloLimit]
    scrape_metrics: bool = True
    sample_interval_s: float = 1.0
    on_record: Callable[[RequestRecord], None] | None = None
    on_start: Callable[[LoadConfig], None] | None = None
    agent: bool = False  # add the agent-session view (per-user speed, per-turn TTFT and hits) to each run
    floor_tps: float | None = None  # the per-user speed floor the agent view checks

    def __post_init__(self) -> None:
        self.results: list[RunResult] = []

    def __call__(self, load: LoadConfig) -> dict[str, Any]:
        if self.on_start is not None:
            self.on_start(load)
        before = server_metrics.scrape(self.client.base_url) if self.scrape_metrics else None
        sampler = server_metrics.GaugeSampler(self.client.base_url, self.sample_interval_s)
        if before is not None:
            with sampler:
                result = run_load(self.client, load, self.workload, self.on_record)
        else:
            result = run_load(self.client, load, self.workload, self.on_record)
        after = server_metrics.scrape(self.client.base_url) if self.scrape_metrics else None
        self.results.append(result)
        summary = summarize(result.records, result.start_ns, result.end_ns, self.slos)
        server = server_metrics.diff(before, after)
        if server is not None:
            server["during_run"] = sampler.summary()
            kv = server["during_run"].get("vllm:kv_cache_usage_perc")
            server["derived"]["kv_cache_usage_max"] = kv["max"] if kv else None
            server["derived"]["kv_cache_usage_mean"] = kv["mean"] if kv else None
        entry = run_entry(result, summary, server)
        if self.agent:
            entry["agent"] = agent_summary(result.records, self.floor_tps)
        return entry


def with_value(load: LoadConfig, kind: str, value: float) -> LoadConfig:
    """``load`` at concurrency ``value`` (kind "concurrency") or request rate ``value`` (kind "rate")."""
    if kind == "concurrency":
        return replace(load, concurrency=int(value))
    return replace(load, request_rate=float(value))


def sweep(measure: Callable[[LoadConfig], dict[str, Any]], base: LoadConfig, kind: str,
          values: list[float]) -> list[dict[str, Any]]:
    """Measure each value in order."""
    return [measure(with_value(base, kind, v)) for v in values]


def _saturated(prev: dict[str, Any], cur: dict[str, Any]) -> bool:
    p, c = prev["summary"], cur["summary"]
    ttft_p = p["metrics"]["ttft_ms"]["p50"]
    ttft_c = c["metrics"]["ttft_ms"]["p50"]
    if ttft_p is None or ttft_c is None:
        return False
    gain = c["output_token_throughput"] / max(p["output_token_throughput"], 1e-9)
    return gain < SATURATION_GAIN and ttft_c > SATURATION_TTFT_GROWTH * ttft_p


def find_max_load(
    measure: Callable[[LoadConfig], dict[str, Any]],
    base: LoadConfig,
    kind: str,
    start: float = 1,
    max_value: float = 256,
    max_points: int = 12,
    rel_tol: float = 0.1,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Highest load meeting the SLOs (``summary.slo_met``); returns (search report, measured runs)."""
    runs: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []

    def probe(v: float, prev: dict[str, Any] | None) -> tuple[bool, dict[str, Any]]:
        run = measure(with_value(base, kind, v))
        saturated = prev is not None and _saturated(prev, run)
        passed = bool(run["summary"].get("slo_met")) and not saturated
        runs.append(run)
        points.append({"value": v, "label": run["label"], "passed": passed, "saturated": saturated})
        return passed, run

    lo: float | None = None
    hi: float | None = None
    prev: dict[str, Any] | None = None
    stopped_on_saturation = False
    v = start
    while v <= max_value and len(points) < max_points:
        passed, run = probe(v, prev)
        if not passed:
            hi = v
            stopped_on_saturation = points[-1]["saturated"]
            break
        lo, prev = v, run
        v = v * 2
    if lo is not None and hi is not None:
        while len(points) < max_points:
            mid = (lo + hi) // 2 if kind == "concurrency" else (lo + hi) / 2
            if mid <= lo or (kind != "concurrency" and (hi - lo) / hi < rel_tol):
                break
            passed, _ = probe(mid, None)
            lo, hi = (mid, hi) if passed else (lo, mid)
    report = {"kind": kind, "best": lo, "first_failing": hi, "stopped_on_saturation": stopped_on_saturation,
              "points": points}
    return report, runs
