"""The server's own view of a run: ``/metrics`` scraped before and after, and the deltas.

Samples are summed over label sets (a fleet exposes one series per worker). Counters are reported as
after − before; gauges as before/after. Derived rates use the vLLM names: prefix-cache hit rate
= Δhits / Δqueries, speculative acceptance = Δaccepted / Δdraft tokens, mean acceptance length
= 1 + Δaccepted / Δdrafts.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Scrape = dict[str, float]

GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


def parse_prometheus(text: str) -> Scrape:
    """Sample name → value summed over labels (histogram buckets are dropped, _sum/_count kept)."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def scrape(base_url: str, timeout_s: float = 5.0) -> Scrape | None:
    """Scrape ``/metrics``; None if the server has none (the run goes on without server metrics)."""
    try:
        r = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
        if r.status_code != 200:
            return None
        return parse_prometheus(r.text)
    except (httpx.HTTPError, ValueError):
        return None


# The server's own latency histograms: Δsum/Δcount is its mean over the run, to set beside the
# client's numbers (the difference is network, HTTP and detokenization time).
SERVER_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
                     "e2e": "e2e_request_latency_seconds", "queue": "request_queue_time_seconds"}


def _ms(seconds: float | None) -> float | None:
    return seconds * 1000 if seconds is not None else None


def _delta(before: Scrape, after: Scrape, name: str) -> float | None:
    for candidate in (name, name + "_total"):
        if candidate in after:
            return after[candidate] - before.get(candidate, 0.0)
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def diff(before: Scrape | None, after: Scrape | None) -> dict[str, Any] | None:
    """Counter deltas, gauge before/after and the derived rates; None if either scrape failed."""
    if before is None or after is None:
        return None
    counters = {
        name: after[name] - before.get(name, 0.0)
        for name in sorted(after)
        if name.endswith(("_total", "_sum", "_count")) and after[name] != before.get(name, 0.0)
    }
    gauges = {g: {"before": before.get(g), "after": after.get(g)} for g in GAUGES if g in after}
    hits = _delta(before, after, "vllm:prefix_cache_hits")
    queries = _delta(before, after, "vllm:prefix_cache_queries")
    accepted = _delta(before, after, "vllm:spec_decode_num_accepted_tokens")
    drafted = _delta(before, after, "vllm:spec_decode_num_draft_tokens")
    drafts = _delta(before, after, "vllm:spec_decode_num_drafts")
    mean_al = 1 + accepted / drafts if accepted is not None and drafts else None
    server_means = {
        f"server_mean_{short}_ms": _ms(_ratio(_delta(before, after, f"vllm:{name}_sum"),
                                             _delta(before, after, f"vllm:{name}_count")))
        for short, name in SERVER_HISTOGRAMS.items()
    }
    return {
        "derived": {
            **server_means,
            "prefix_cache_hit_rate": _ratio(hits, queries),
            "kv_cache_usage_max": None,  # filled from GaugeSampler samples taken during the run
            "kv_cache_usage_mean": None,
            "spec_acceptance_rate": _ratio(accepted, drafted),
            "spec_mean_acceptance_length": mean_al,
        },
        "gauges": gauges,
        "counter_deltas": counters,
    }


class GaugeSampler:
    """Samples the gauges (KV usage, running, waiting) every ``interval_s`` while a run is on.

    Before/after scrapes miss them: at both ends the server is idle. One scrape a second costs the
    server next to nothing."""

    def __init__(self, base_url: str, interval_s: float = 1.0):
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {g: [] for g in GAUGES}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            got = scrape(self.base_url, timeout_s=self.interval_s)
            for g in GAUGES:
                if got is not None and g in got:
                    self.samples[g].append(got[g])

    def summary(self) -> dict[str, dict[str, float]]:
        """Mean and max of each gauge over the run (gauges never sampled are left out)."""
        return {g: {"mean": sum(v) / len(v), "max": max(v), "samples": len(v)}
                for g, v in self.samples.items() if v}
