"""Metrics from request records; every formula is defined in docs/bench.md.

Names follow the trap the tools set: ``tpot_ms`` here is vLLM's TPOT and what AIPerf calls "ITL"
(per request, per output token); ``itl_ms`` is the mean gap between streamed chunks of one request; and
``chunk_gap_ms`` pools every chunk gap of every request, which is what vLLM calls "ITL".
Latency metrics use successful requests only; errors and cancellations are counted separately and
count against SLO attainment.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetllm.bench.client import RequestRecord
from fleetllm.errors import UsageError, did_you_mean

PERCENTILES = (50, 90, 95, 99)
PER_REQUEST = ("ttft_ms", "ttst_ms", "itl_ms", "tpot_ms", "e2e_ms", "output_tps_per_user", "input_tokens",
               "output_tokens")
LATENCY_METRICS = ("ttft_ms", "ttst_ms", "itl_ms", "tpot_ms", "e2e_ms", "chunk_gap_ms")
NS_PER_MS = 1e6


def request_metrics(rec: RequestRecord) -> dict[str, float | None]:
    """Per-request metrics; a value is None where it is undefined (e.g. ITL with one chunk)."""
    out: dict[str, float | None] = dict.fromkeys(PER_REQUEST)
    out["input_tokens"] = rec.input_tokens if rec.input_tokens is not None else rec.expected_input_tokens
    out["output_tokens"] = rec.output_tokens
    if not rec.chunk_ns:
        return out
    first, last = rec.chunk_ns[0], rec.chunk_ns[-1]
    e2e = rec.end_ns - rec.start_ns
    ttft = first - rec.start_ns
    out["ttft_ms"] = ttft / NS_PER_MS
    out["e2e_ms"] = e2e / NS_PER_MS
    if len(rec.chunk_ns) >= 2:
        out["ttst_ms"] = (rec.chunk_ns[1] - first) / NS_PER_MS
        out["itl_ms"] = (last - first) / (len(rec.chunk_ns) - 1) / NS_PER_MS
    n_out = rec.output_tokens or 0
    if n_out >= 2 and e2e > ttft:
        out["tpot_ms"] = (e2e - ttft) / (n_out - 1) / NS_PER_MS
        out["output_tps_per_user"] = (n_out - 1) / ((e2e - ttft) / 1e9)
    return out


def chunk_gaps_ms(rec: RequestRecord) -> list[float]:
    """Every gap between consecutive streamed chunks of one request, in ms."""
    return [(b - a) / NS_PER_MS for a, b in zip(rec.chunk_ns, rec.chunk_ns[1:], strict=False)]


def stats(values: list[float]) -> dict[str, float | int | None]:
    """count, mean, min, max, stddev (population) and p50/p90/p95/p99 (linear interpolation)."""
    if not values:
        return {"count": 0, "mean": None, "min": None, "max": None, "std": None,
                **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=float)
    out: dict[str, float | int | None] = {
        "count": int(a.size), "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()),
        "std": float(a.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


@dataclass(frozen=True)
class SloLimit:
    """``metric`` at ``stat`` must be <= ``limit`` (``stat`` None: a per-request limit, for goodput)."""

    metric: str
    stat: str | None
    limit: float


def parse_slos(text: str) -> list[SloLimit]:
    """Parse ``ttft_ms=500,tpot_ms=50`` (per request) and ``ttft_p99_ms=800`` (aggregate) limits."""
    limits = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        parts = key.strip().split("_")
        stat = next((p for p in parts if p in {f"p{q}" for q in PERCENTILES} | {"mean", "max"}), None)
        metric = "_".join(p for p in parts if p != stat)
        known = set(LATENCY_METRICS) | {"output_tps_per_user"}
        if metric not in known:
            raise UsageError(f"unknown SLO metric {metric!r} in {item!r}{did_you_mean(metric, known)} (known: "
                             f"{', '.join(sorted(known))}; e.g. ttft_ms=500 or ttft_p99_ms=800)")
        try:
            limits.append(SloLimit(metric, stat, float(value)))
        except ValueError:
            raise UsageError(f"SLO {item!r}: the limit is a number (e.g. {key}=500)") from None
    return limits


def _meets(m: dict[str, float | None], limit: SloLimit) -> bool:
    v = m.get(limit.metric)
    if v is None:
        return limit.metric in ("ttst_ms", "itl_ms", "tpot_ms")  # undefined for 1-token outputs: no breach
    if limit.metric == "output_tps_per_user":
        return v >= limit.limit  # a speed: higher is better
    return v <= limit.limit


def summarize(
    records: list[RequestRecord], start_ns: int, end_ns: int, slos: list[SloLimit] | None = None
) -> dict[str, Any]:
    """The summary of one run: counts, throughputs, metric distributions, goodput and SLO checks."""
    slos = slos or []
    ok = [r for r in records if r.ok]
    per = [request_metrics(r) for r in ok]
    # Duration spans the measured requests themselves, so idle tails of the runner do not dilute rates.
    if records:
        start_ns = min(r.start_ns for r in records)
        end_ns = max(r.end_ns for r in records)
    duration_s = max(end_ns - start_ns, 1) / 1e9
    in_tokens = sum(int(m["input_tokens"] or 0) for m in per)
    out_tokens = sum(int(m["output_tokens"] or 0) for m in per)
    errors = Counter(r.error for r in records if r.error is not None)
    summary: dict[str, Any] = {
        "requests": {"total": len(records), "completed": len(ok), "errors": sum(errors.values()),
                     "cancelled": sum(1 for r in records if r.cancelled and r.error is None)},
        "errors_by_kind": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "input_token_throughput": in_tokens / duration_s,
        "output_token_throughput": out_tokens / duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "metrics": {},
    }
    for name in PER_REQUEST:
        summary["metrics"][name] = stats([m[name] for m in per if m[name] is not None])
    summary["metrics"]["chunk_gap_ms"] = stats([g for r in ok for g in chunk_gaps_ms(r)])
    per_request_slos = [s for s in slos if s.stat is None]
    if per_request_slos:
        # Errors and cancellations are in the denominator: a failed request did not meet the SLO.
        good = sum(1 for m in per if all(_meets(m, s) for s in per_request_slos))
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(records) if records else 0.0
    aggregate = [s for s in slos if s.stat is not None]
    if aggregate:
        checks = {}
        for s in aggregate:
            value = summary["metrics"].get(s.metric, {}).get(s.stat)
            passed = value is not None and (value >= s.limit if s.metric == "output_tps_per_user" else value <= s.limit)
            checks[f"{s.metric.removesuffix('_ms')}_{s.stat}{'_ms' if s.metric.endswith('_ms') else ''}"] = {
                "value": value, "limit": s.limit, "passed": passed}
        summary["slo_checks"] = checks
        summary["slo_met"] = all(c["passed"] for c in checks.values()) and not errors
    return summary
