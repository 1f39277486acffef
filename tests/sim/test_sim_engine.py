"""The simulated worker's engine: the real LLMEngine over the timing executor, no model and no PyTorch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.params import PromptTooLong, SamplingParams
from fleetllm.models.source import load_tokenizer
from fleetllm.sim.engine import SimConfig, sim_engine
from fleetllm.sim.executor import TimingExecutor

FAST = 1000.0  # the timing model 1000x faster than real time: tests wait for nothing


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return load_tokenizer("smollm2-135m")


def engine(model, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    config, tokenizer = model
    return sim_engine(SimConfig(speed=FAST, **kw), tokenizer, config)


def run(eng: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> tuple[list[int], str, str, int]:
    eng.add_request(rid, ids, params)
    tokens, text = [], ""
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
            text += out.new_text
            if out.finished:
                return tokens, text, out.finish_reason, out.num_cached_tokens
    raise AssertionError("no final output")


def test_it_is_the_real_engine_over_the_timing_executor(model) -> None:
    eng = engine(model)
    assert type(eng) is LLMEngine and isinstance(eng.executor, TimingExecutor)
    assert eng.warm_up() == 0.0  # nothing to warm
    tokens, text, reason, _ = run(eng, "a", list(range(100, 120)), SamplingParams(max_tokens=5))
    assert len(tokens) == 5 and reason == "length" and text
    assert eng.executor.simulated_seconds > 0
    assert eng.pool.num_free == eng.pool.num_blocks


def test_a_request_without_max_tokens_gets_the_default(model) -> None:
    tokens, _, reason, _ = run(engine(model, default_max_tokens=7), "a", [100, 101, 102], SamplingParams(max_tokens=None))
    assert (len(tokens), reason) == (7, "length")


def test_a_stop_string_ends_the_synthetic_text(model) -> None:
    _, text, reason, _ = run(engine(model), "a", [100, 101], SamplingParams(max_tokens=64, stop=["replica"]))
    assert reason == "stop" and "replica" not in text


def test_a_repeated_prompt_hits_the_prefix_cache_and_publishes_kv_events(model) -> None:
    eng = engine(model)
    events: list[tuple[str, list[int]]] = []
    eng.pool.on_event = lambda kind, hashes: events.append((kind, hashes))
    ids = list(range(200, 240))
    run(eng, "a", ids, SamplingParams(max_tokens=2))
    *_, cached = run(eng, "b", ids, SamplingParams(max_tokens=2))
    assert cached == 32  # two whole blocks; the hit stops short of the last token
    assert [k for k, _ in events] == ["stored"] * len(events) and len(events) >= 2


def test_the_context_limit_is_the_real_engines_rule(model) -> None:
    eng = engine(model, num_blocks=150, block_size=16)
    # the watermark (1% of 150 = 1 block) stays free; the rest holds one sequence
    assert eng.max_model_len == (150 - 1) * 16
    with pytest.raises(PromptTooLong):
        eng.add_request("long", [100] * eng.max_model_len, SamplingParams(max_tokens=1))


NO_TORCH = """
import sys
from starlette.testclient import TestClient
from fleetllm.sim.engine import SimConfig
from fleetllm.sim.server import build_workers

(worker,) = build_workers("smollm2-135m", 1, SimConfig(speed=1000.0), None)
with TestClient(worker.app) as client:  # served: the app's lifespan, engine thread and thread pool
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
assert "torch" not in sys.modules, "torch was imported"
"""


def test_the_simulated_worker_never_loads_pytorch() -> None:
    subprocess.run([sys.executable, "-c", NO_TORCH], check=True, timeout=120)


def test_a_step_pays_a_modelled_load_each_time_a_slot_takes_another_adapter(model, tmp_path) -> None:
    from fleet_helpers import smollm2_adapter

    eng = engine(model, enable_lora=True, max_loras=1, lora_load_s=0.5)
    for i, name in enumerate(("a1", "a2")):
        eng.load_lora(name, smollm2_adapter(tmp_path / name, seed=i))
    for i, name in enumerate(("a1", "a1", "a2", "a1", None)):  # one slot: a2 evicts a1, which comes back
        eng.add_request(f"r{i}", list(range(100, 120)), SamplingParams(max_tokens=2), lora_name=name)
        while eng.has_unfinished():
            eng.step()
    assert eng.executor.lora_loads == 3
