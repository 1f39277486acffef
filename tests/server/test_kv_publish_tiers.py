"""The vLLM-format publisher says where a worker holds its blocks: a block the pool evicts into the host-memory
tier is published again as ``CPU``, and removed as ``CPU`` when the tier drops it; the router indexes it so."""

from __future__ import annotations

import torch

from fleetllm.engine.block_pool import BlockPool
from fleetllm.kvtier.host import HostBlock, HostStore
from fleetllm.router.backends.vllm_events import apply_event
from fleetllm.router.backends.vllm_wire import decode_batch, encode_batch
from fleetllm.router.index import POOL, PrefixIndex
from fleetllm.server.kv_publish import VllmEventPublisher

BS = 4


def _block(token_ids: tuple[int, ...]) -> HostBlock:
    return HostBlock(token_ids, torch.zeros(1, BS, 1, 2), torch.zeros(1, BS, 1, 2))  # 64 bytes


def _published(pub: VllmEventPublisher, index: PrefixIndex) -> list[tuple[str, str]]:
    """The pending events' (kind, medium), applied to ``index`` as the router would."""
    _, events = decode_batch(encode_batch(0.0, pub.pending))
    pub.pending = []
    for ev in events:
        apply_event(index, "w", ev)
    return [(ev.kind, ev.medium) for ev in events]


def test_a_block_evicted_into_host_memory_is_published_as_cpu_and_its_drop_as_a_cpu_removal() -> None:
    pool = BlockPool(num_blocks=1, block_size=BS)
    store = HostStore(capacity_bytes=64)  # one block
    pub = VllmEventPublisher(pool, {"endpoint": "tcp://127.0.0.1:0"}, seed="0")  # not started: events stay pending
    pool.on_event = pub.on_pool_event
    pub.watch_tier("CPU", store.listeners)
    pool.on_evict.append(lambda gone: [store.put(h, _block(ids)) for _, h, ids in gone])  # as the host tier does
    index = PrefixIndex(routed_ttl_s=0)

    (bid,) = pool.allocate(1)
    pool.register(bid, 101, (1, 2, 3, 4))
    assert _published(pub, index) == [("BlockStored", POOL)]
    pool.release([bid])
    (bid,) = pool.allocate(1)  # evicts block 101 into the store
    assert _published(pub, index) == [("BlockRemoved", POOL), ("BlockStored", "CPU")]
    keys = set(index.tiers["w"]["CPU"])
    assert len(keys) == 1 and not index.exact["w"]
    assert index.match_media(list(keys), ["w"]) == {"w": ["CPU"]}
    pool.register(bid, 202, (5, 6, 7, 8))
    pool.release([bid])
    pool.allocate(1)  # evicts 202 into the store, which drops 101 to make room
    assert _published(pub, index)[-2:] == [("BlockRemoved", "CPU"), ("BlockStored", "CPU")]
    assert not keys & index.tiers["w"]["CPU"] and len(index.tiers["w"]["CPU"]) == 1


def test_a_block_a_tier_writes_after_the_pool_evicted_it_is_published_with_its_vllm_hash() -> None:
    pool = BlockPool(num_blocks=1, block_size=BS)
    pub = VllmEventPublisher(pool, {"endpoint": "tcp://127.0.0.1:0"}, seed="0")
    pool.on_event = pub.on_pool_event
    index = PrefixIndex(routed_ttl_s=0)
    (bid,) = pool.allocate(1)
    pool.register(bid, 101, (1, 2, 3, 4))
    pool.release([bid])
    (bid,) = pool.allocate(1)  # 101 evicted
    pool.register(bid, 202, (5, 6, 7, 8))
    pool.release([bid])
    pool.allocate(1)  # and 202 after it: the disk tier's writer gets to 101 only now
    _published(pub, index)
    pub.on_tier_event("DISK", "stored", [101], [1, 2, 3, 4])
    assert _published(pub, index) == [("BlockStored", "DISK")]
    assert len(index.tiers["w"]["DISK"]) == 1
