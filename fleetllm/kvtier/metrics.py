"""Per-tier KV metrics on a worker's ``/metrics``: hits, misses, bytes, load seconds, errors.

One family of each per registry, shared by every tier on it (label ``tier``: ``host``, ``disk``, ``remote``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_SECONDS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Families:
    """The tier series of one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.hits = Counter("fleetllm:kv_tier_hits", "Prompt blocks loaded from a KV tier instead of recomputed.",
                            ["tier"], registry=registry)
        self.misses = Counter("fleetllm:kv_tier_misses", "Prompt blocks missing from both the pool and a KV tier "
                              "(computed).", ["tier"], registry=registry)
        self.bytes = Counter("fleetllm:kv_tier_bytes", "KV bytes stored into or loaded from a KV tier.",
                             ["tier", "direction"], registry=registry)
        self.load_seconds = Histogram("fleetllm:kv_tier_load_seconds", "Time to copy one step's blocks from a KV "
                                      "tier into the pool.", ["tier"], buckets=_SECONDS, registry=registry)
        self.errors = Counter("fleetllm:kv_tier_errors", "KV tier operations that failed (the blocks computed "
                              "instead): op=store|load|corrupt.", ["tier", "op"], registry=registry)
        self.used = Gauge("fleetllm:kv_tier_used_bytes", "Bytes a KV tier holds (this worker's count).", ["tier"],
                          registry=registry)
        self.degraded = Gauge("fleetllm:kv_tier_degraded", "1 while a KV tier's store fails (its last call did): "
                              "lookups and writes skipped, blocks computed instead.", ["tier"], registry=registry)


_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


class TierMetrics:
    """One tier's series, labelled ``tier`` (``host``, ``disk``, ``remote``)."""

    def __init__(self, registry: CollectorRegistry, tier: str) -> None:
        fam = _FAMILIES.get(registry)
        if fam is None:
            fam = _FAMILIES[registry] = _Families(registry)
        self.hits = fam.hits.labels(tier=tier)
        self.misses = fam.misses.labels(tier=tier)
        self.bytes = fam.bytes  # labelled per use: tier and direction
        self.load_seconds = fam.load_seconds.labels(tier=tier)
        self.errors = fam.errors  # labelled per use: tier and op
        self.used = fam.used.labels(tier=tier)
        self.degraded = fam.degraded.labels(tier=tier)
        self.tier = tier
