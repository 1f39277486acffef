"""A stored tier tells its listeners (the worker's KV events) what it holds, with its medium: a disk tier
publishes each block once written (``DISK``) and each file its byte cap removes; the shared tier (``SHARED``)
publishes its writes, and a block Redis lost (found absent by a lookup) as removed — then writes it again."""

from __future__ import annotations

from pathlib import Path

from fleetllm.engine.block_pool import hash_prefix_blocks
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.kvtier.attach import attach_tiers
from fleetllm.kvtier.codec import _HEADER
from fleetllm.models.loader import LoadedModel
from tests.kvtier.tier_helpers import FULL_BLOCKS, close, engine_with, flush, prompt, run

Events = list[tuple[str, list[int]]]


def listen(tier) -> Events:  # noqa: ANN001 - a TierConnector
    events: Events = []
    tier.listeners.append(lambda kind, hashes, _ids: events.append((kind, list(hashes))))
    return events


def hashes(engine: LLMEngine, ids: list[int]) -> list[int]:
    return hash_prefix_blocks(ids[:FULL_BLOCKS], 16, engine.kv.extra_key)


def of(events: Events, kind: str) -> list[int]:
    return [h for k, hs in events if k == kind for h in hs]


def test_a_disk_tier_publishes_the_blocks_it_writes_and_those_its_cap_removes(loaded_model: LoadedModel,
                                                                               tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=32, max_num_batched_tokens=128), loaded=loaded_model)
    layers = engine.kv_blocks()
    block = 2 * len(layers) * layers[0][0][0].numel() * layers[0][0].element_size() + _HEADER.size + 4 * 16
    (tier,) = attach_tiers(engine, disk_dir=tmp_path, disk_gb=8 * block / 2**30)  # room for 8 blocks
    events = listen(tier)
    run(engine, prompt(41))
    flush([tier])
    first = hashes(engine, prompt(41))
    assert tier.medium == "DISK" and of(events, "stored") == first and not of(events, "removed")
    run(engine, prompt(43))
    flush([tier])
    close([tier])
    assert of(events, "stored") == first + hashes(engine, prompt(43))
    assert of(events, "removed") == first[:4]  # the least recently used, to make room for 4 more
    assert set(tier.held()) == set(first[4:] + hashes(engine, prompt(43)))


def test_a_block_redis_lost_is_published_removed_and_written_again(loaded_model: LoadedModel, redis_server) -> None:
    engine, (tier,) = engine_with(loaded_model, remote=redis_server.url)
    events = listen(tier)
    ids = prompt(47)
    run(engine, ids)
    flush([tier])
    blocks = hashes(engine, ids)
    assert tier.medium == "SHARED" and tier.namespace and of(events, "stored") == blocks
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.delete(f"fleetllm:kv:{tier.namespace}:{blocks[0]:016x}")  # Redis evicted the first block
    engine.pool.reset_prefix_cache()  # the pool forgets it too: the prompt asks the tier
    _, out = run(engine, ids)
    flush([tier])
    close([tier])
    assert out.num_cached_tokens == 0
    assert of(events, "removed") == blocks[:1]
    assert of(events, "stored")[len(blocks):] == blocks[:1]  # written again when the request finished
    assert client.exists(f"fleetllm:kv:{tier.namespace}:{blocks[0]:016x}")
    client.close()
