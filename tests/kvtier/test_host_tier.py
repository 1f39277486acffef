"""The host-memory KV tier (--kv-offload-gb): blocks evicted from a pool too small for the traffic are brought
back instead of recomputed, counted as cached tokens, and the output is the one recomputing gives."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from fleetllm.engine.engine import EngineConfig, LLMEngine, RequestOutput
from fleetllm.engine.params import SamplingParams
from fleetllm.kernels import kv8
from fleetllm.kvtier.attach import attach_tiers
from fleetllm.kvtier.host import HostBlock, HostStore
from fleetllm.models.loader import LoadedModel

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 7919 + 31 * i) % 3000 + 100 for i in range(n)]


def run(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[list[int], RequestOutput]:
    """Every token ``rid`` generated, and its final output."""
    engine.add_request(rid, ids, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and not outs[-1].error
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def session(engine: LLMEngine) -> tuple[list[list[int]], RequestOutput]:
    """A prompt, four others that evict its blocks from a 24-block pool, then the first again."""
    first = prompt(1)
    runs = [run(engine, "a", first)] + [run(engine, f"other-{k}", prompt(k + 2)) for k in range(4)]
    runs.append(run(engine, "a-again", first))
    return [tokens for tokens, _ in runs], runs[-1][1]


@pytest.fixture(scope="module")
def runs(loaded_model: LoadedModel) -> dict[str, tuple[LLMEngine, list[list[int]], RequestOutput]]:
    out = {}
    for name, gb in (("off", 0.0), ("on", 0.05)):
        # an fp32 pool (whatever auto is on the fast path): the "off" run recomputes an evicted prefix, attending within its
        # chunk over K/V as computed, where the "on" run reads them back from the pool rounded to bf16
        engine = LLMEngine(EngineConfig(num_blocks=24, max_num_batched_tokens=128, kv_cache_dtype="fp32"),
                           loaded=loaded_model)
        attach_tiers(engine, gb)
        out[name] = (engine, *session(engine))
    return out


def test_a_prefix_evicted_from_the_pool_is_loaded_from_host_memory_and_counted_cached(runs) -> None:
    _, _, off = runs["off"]
    _, _, on = runs["on"]
    assert on.num_cached_tokens == (len(prompt(1)) - 1) // 16 * 16  # every full block back, from one tier or the other
    assert off.num_cached_tokens < on.num_cached_tokens  # without the tier the pool lost some: computed again


def test_the_output_is_token_identical_with_the_tier_on_or_off(runs) -> None:
    assert runs["on"][1] == runs["off"][1]


def test_the_tier_reports_hits_bytes_and_load_time_on_the_engines_metrics(runs) -> None:
    engine, _, _ = runs["on"]
    text = generate_latest(engine.metrics.registry).decode()
    hits = [ln for ln in text.splitlines() if ln.startswith('fleetllm:kv_tier_hits_total{tier="host"}')]
    assert hits and float(hits[0].split()[-1]) > 0
    assert 'fleetllm:kv_tier_bytes_total{direction="loaded",tier="host"}' in text
    assert 'fleetllm:kv_tier_load_seconds_count{tier="host"}' in text
    engine.pool.check()


def test_the_tier_measures_its_load_time_a_block_for_the_router_to_price(runs) -> None:
    from fleetllm.kvtier.connector import HostTierConnector

    tier = runs["on"][0].kv_connector_of(HostTierConnector)
    assert tier is not None and tier._loaded_blocks > 0  # the session's prefix came back from here
    assert 0.0 < tier.load_s_per_block() < 1.0
    assert HostTierConnector(1 << 20).load_s_per_block() is None  # nothing loaded: nothing measured


def test_the_host_store_drops_the_least_recently_used_block_and_rechecks_tokens() -> None:
    def block(t: int) -> HostBlock:
        return HostBlock((t,), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))  # 32 bytes

    store = HostStore(capacity_bytes=64)
    store.put(1, block(1))
    store.put(2, block(2))
    assert store.get(1, (1,)) is not None  # 1 is now the more recent
    store.put(3, block(3))
    assert store.get(2, (2,)) is None and store.get(1, (1,)) is not None and store.get(3, (3,)) is not None
    assert store.get(3, (4,)) is None  # a hash whose tokens differ is a miss
    assert store.used_bytes == 64


def test_a_waiting_prompts_prefix_held_in_the_pool_or_host_memory_is_left_out_of_the_queued_prefill(runs) -> None:
    queued = {}
    for name, ids in (("off", prompt(2)), ("on", prompt(2)), ("pool", prompt(1))):
        engine = runs["off" if name == "pool" else name][0]
        engine.add_request("back", ids, GREEDY)  # prompt(2): evicted from the pool; prompt(1): just run again
        queued[name] = engine.scheduler.queued_prefill_tokens()
        engine.abort_request("back")
        engine.take_outputs()
    assert queued == {"off": 100, "on": 100 - 96, "pool": 100 - 96}  # 6 full blocks held: a load or a hit


def test_host_memory_keeps_blocks_in_fp8_when_asked_and_loads_them_back(loaded_model: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=24, max_num_batched_tokens=128, kv_cache_dtype="fp32"),
                       loaded=loaded_model)
    (tier,) = attach_tiers(engine, 0.05, offload_dtype="fp8")
    _, again = session(engine)
    layers, (_, bs, heads, dim) = len(engine.kv_blocks()), engine.kv_blocks()[0][0].shape
    assert again.num_cached_tokens == (len(prompt(1)) - 1) // 16 * 16  # every full block back
    row = kv8.row_width(dim, torch.float8_e4m3fn)  # the 8-bit cache's row: values and their scales
    assert len(tier.store) > 0 and tier.store.used_bytes == len(tier.store) * 2 * layers * bs * heads * row
    engine.pool.check()
