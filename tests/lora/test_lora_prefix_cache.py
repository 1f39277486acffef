"""An adapter's identity is part of its blocks' hashes: a prefix computed under adapter A is never served to adapter
B or to the base model, only to A again; unloading A forgets its prefixes."""

from __future__ import annotations

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams

PROMPT = [1, *range(100, 150)]  # three full blocks of 16 and some


def cached(llm: LLM, lora: str | None) -> int:
    res = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0), lora_name=lora)
    return res[0].num_cached_tokens


def test_a_prefix_hit_for_one_adapter_is_never_served_to_another_or_to_the_base(tiny_lora) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64)
    for name in ("qv4", "all8"):
        llm.load_lora(name, str(tiny_lora.dirs[name]))
    assert [cached(llm, n) for n in ("qv4", "all8", None)] == [0, 0, 0]
    assert [cached(llm, n) for n in ("qv4", "all8", None)] == [48, 48, 48]


def test_unloading_an_adapter_forgets_its_cached_prefixes(tiny_lora) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64)
    llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    cached(llm, "qv4")
    llm.unload_lora("qv4")
    llm.load_lora("qv4", str(tiny_lora.dirs["all8"]))  # the same name, other weights
    assert (cached(llm, "qv4"), cached(llm, None)) == (0, 0)


def test_kv_events_name_the_adapter_of_each_stored_block(tiny_lora) -> None:
    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64)
    llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    pool, stored = llm.engine.pool, []
    pool.on_event = lambda kind, hashes: stored.extend(h for h in hashes if kind == "stored")
    cached(llm, "qv4")
    cached(llm, None)
    names = [pool.blocks[pool.cached[h]].lora_name for h in stored]
    assert names == ["qv4"] * 3 + [None] * 3


def test_vllm_format_kv_events_carry_the_adapter_and_hash_it_as_vllm_does(tiny_lora) -> None:
    from fleetllm.router.backends.vllm_hash import VllmHasher, external_hash
    from fleetllm.server.kv_publish import VllmEventPublisher

    llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64)
    llm.load_lora("qv4", str(tiny_lora.dirs["qv4"]))
    pub = VllmEventPublisher(llm.engine.pool, {"endpoint": "tcp://127.0.0.1:0"}, seed="0")  # not bound: no socket
    llm.engine.pool.on_event = pub.on_pool_event
    cached(llm, "qv4")
    cached(llm, None)
    events = [e for e in pub.pending if e["type"] == "BlockStored"]
    first = VllmHasher("sha256", "0", 16).digest(None, PROMPT[:16], "qv4")  # vLLM's extra keys: (lora_name,)
    assert [e["lora_name"] for e in events] == ["qv4", None]
    assert events[0]["block_hashes"][0] == external_hash(first) != events[1]["block_hashes"][0]
