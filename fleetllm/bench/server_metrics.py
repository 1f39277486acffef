"""The server's own view of a run: ``/metrics`` scraped before and after, and the deltas.

Samples are summed over label sets (a fleet exposes one series per worker). Counters are reported as
after − before; gauges as before/after. Derived rates use the vLLM names: prefix-cache hit rate
= Δhits / Δqueries, speculative acceptance = Δaccepted / Δdraft tokens, mean acceptance length
= 1 + Δaccepted / Δdrafts.
"""

from __future__ import annotations

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
    return {
        "derived": {
            "prefix_cache_hit_rate": _ratio(hits, queries),
            "kv_cache_usage_after": after.get("vllm:kv_cache_usage_perc"),
            "spec_acceptance_rate": _ratio(accepted, drafted),
            "spec_mean_acceptance_length": mean_al,
        },
        "gauges": gauges,
        "counter_deltas": counters,
    }
