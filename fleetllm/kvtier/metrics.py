"""Per-tier KV metrics on a worker's ``/metrics``: hits, misses, bytes, load seconds, errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_SECONDS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class TierMetrics:
    """One tier's series, labelled ``tier`` (``host``)."""

    def __init__(self, registry: CollectorRegistry, tier: str) -> None:
        self.hits = Counter("fleetllm:kv_tier_hits", "Prompt blocks loaded from a KV tier instead of recomputed.",
                            ["tier"], registry=registry).labels(tier=tier)
        self.misses = Counter("fleetllm:kv_tier_misses", "Prompt blocks missing from both the pool and a KV tier "
                              "(computed).", ["tier"], registry=registry).labels(tier=tier)
        self.bytes = Counter("fleetllm:kv_tier_bytes", "KV bytes stored into (blocks evicted from the pool) or "
                             "loaded from a KV tier.", ["tier", "direction"], registry=registry)
        self.load_seconds = Histogram("fleetllm:kv_tier_load_seconds", "Time to copy one step's blocks from a KV "
                                      "tier into the pool.", ["tier"], buckets=_SECONDS,
                                      registry=registry).labels(tier=tier)
        self.errors = Counter("fleetllm:kv_tier_errors", "KV tier operations that failed (the blocks computed "
                              "instead).", ["tier", "op"], registry=registry)
        self.used = Gauge("fleetllm:kv_tier_used_bytes", "Bytes a KV tier holds.", ["tier"],
                          registry=registry).labels(tier=tier)
        self.tier = tier
