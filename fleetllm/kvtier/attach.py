"""The tiers a worker's flags ask for, attached to its engine in order: host memory, then disk, then Redis.

A request's blocks come from the first tier holding the run that follows its pool hit (the multi-connector's
one source per request), so the cheaper tier answers first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fleetllm.kvtier.connector import HostTierConnector, TierConnector
from fleetllm.kvtier.metrics import TierMetrics
from fleetllm.kvtier.remote import no_auto
from fleetllm.router.index import SHARED

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.kvtier.stored import StoredTierConnector

log = logging.getLogger("fleetllm.kvtier")


def attach_tiers(engine: LLMEngine, offload_gb: float = 0.0, disk_dir: str | Path | None = None,
                 disk_gb: float = 0.0, remote: str | None = None, offload_dtype: str = "auto") -> list[TierConnector]:
    """Attach the tiers asked for to ``engine`` (their metrics on its registry); the tiers attached. The disk
    and shared tiers need KV tensors: a simulated worker gets none of them. ``offload_dtype``: how host memory
    keeps blocks (``--kv-offload-dtype``)."""
    no_auto(remote)
    tiers: list[TierConnector] = []
    registry = engine.metrics.registry
    if offload_gb > 0:
        tiers.append(HostTierConnector(int(offload_gb * 2**30), TierMetrics(registry, "host"), offload_dtype))
    ns = _namespace(engine) if disk_dir or remote else None
    if ns is not None and disk_dir and disk_gb > 0:
        tiers.append(_disk(Path(disk_dir) / ns, int(disk_gb * 2**30), TierMetrics(registry, "disk")))
    if ns is not None and remote:
        tiers.append(_remote(remote, ns, TierMetrics(registry, "remote")))
    for tier in tiers:
        engine.add_kv_connector(tier)
    return tiers


def _namespace(engine: LLMEngine) -> str | None:
    """The engine's KV layout as a namespace (None: the engine holds no KV tensors)."""
    from fleetllm.kvtier.codec import namespace

    try:
        layers = engine.kv_blocks()
    except RuntimeError:
        return None
    k = layers[0][0]
    dtype = str(k.dtype).removeprefix("torch.")
    return namespace(engine.model_name, engine.loaded.revision, dtype, k.shape[1], (len(layers), *k.shape[2:]))


def _disk(root: Path, capacity: int, metrics: TierMetrics) -> StoredTierConnector:
    from fleetllm.kvtier.disk import DiskStore
    from fleetllm.kvtier.stored import StoredTierConnector

    store = DiskStore(root, capacity)
    metrics.used.set(store.used_bytes)

    def put(block_hash: int, data: bytes) -> None:
        store.put(block_hash, data)
        metrics.used.set(store.used_bytes)

    log.info("disk KV tier: %s (%d blocks kept from before, %.2f GiB at most)", root, len(store), capacity / 2**30)
    tier = StoredTierConnector("disk", store.get_many, put, metrics, drop=store.drop, medium="DISK", held=store.hashes,
                               has=store.__contains__)
    store.on_removed = tier.gone
    return tier


def _remote(url: str, ns: str, metrics: TierMetrics) -> StoredTierConnector:
    from fleetllm.kvtier.remote import RedisStore
    from fleetllm.kvtier.stored import StoredTierConnector

    store = RedisStore(url, ns)

    def health(ok: bool) -> None:
        metrics.degraded.set(0 if ok else 1)
        if ok:
            log.info("shared KV tier: %s answers: loading and storing blocks", store.url)
        else:
            log.warning("shared KV tier: %s fails: blocks computed, not loaded, until it answers", store.url)

    store.on_health = health
    log.info("shared KV tier: %s (keys %s*)", store.url, store.prefix)
    tier = StoredTierConnector("remote", store.get_many, store.put, metrics, medium=SHARED)
    tier.namespace = ns  # every worker of this layout reads the same keys: the router's scope for them
    return tier
