"""What the disk and shared tier tests share: an engine with tiers, one greedy request run through it."""

from __future__ import annotations

import httpx
from prometheus_client import generate_latest

from fleetllm.engine.engine import EngineConfig, LLMEngine, RequestOutput
from fleetllm.engine.params import SamplingParams
from fleetllm.kvtier.attach import attach_tiers
from fleetllm.kvtier.connector import TierConnector
from fleetllm.models.loader import LoadedModel

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FULL_BLOCKS = 96  # a 100-token prompt: its 6 full blocks of 16 (the last token is always computed)


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 7919 + 31 * i) % 3000 + 100 for i in range(n)]


def engine_with(loaded: LoadedModel, **tiers: object) -> tuple[LLMEngine, list[TierConnector]]:
    engine = LLMEngine(EngineConfig(num_blocks=32, max_num_batched_tokens=128), loaded=loaded)
    return engine, attach_tiers(engine, **tiers)  # type: ignore[arg-type]


def run(engine: LLMEngine, ids: list[int], rid: str = "r") -> tuple[list[int], RequestOutput]:
    """Every token the request generated, and its final output; the tiers' writes flushed after."""
    engine.add_request(rid, ids, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and not outs[-1].error, outs[-1].error
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def flush(tiers: list[TierConnector]) -> None:
    for t in tiers:
        if hasattr(t, "writer"):
            t.writer.flush()


def close(tiers: list[TierConnector]) -> None:
    for t in tiers:
        t.close()


def metric(engine: LLMEngine, prefix: str) -> float:
    """The sum of the engine's samples whose line starts with ``prefix`` (0: none)."""
    text = generate_latest(engine.metrics.registry).decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(prefix))


def complete(url: str, ids: list[int]) -> dict:
    """A greedy 4-token completion of ``ids`` from the worker at ``url`` (asserted answered 200)."""
    body = {"model": "smollm2-135m", "prompt": ids, "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()
