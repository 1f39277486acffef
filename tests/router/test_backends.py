"""Other engines behind the router: worker specs, each engine's load from its own metric names (pages in
tests/data/engine_metrics), detection of a plain URL's engine, and requests routed to them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fleet_helpers import ThreadServers, router, wait_state
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from fleetllm.router.backends import BACKENDS, parse_worker
from fleetllm.router.backends.llamacpp import slots_load

PAGES = Path(__file__).parent.parent / "data" / "engine_metrics"


def test_worker_specs() -> None:
    assert parse_worker("vllm+http://10.0.0.5:8000/") == ("vllm", "http://10.0.0.5:8000")
    assert parse_worker("127.0.0.1:8001") == (None, "http://127.0.0.1:8001")
    assert parse_worker("http://h:1") == (None, "http://h:1")
    with pytest.raises(ValueError, match="unknown engine kind"):
        parse_worker("ollama+http://h:1")


@pytest.mark.parametrize(("kind", "want"), [
    ("vllm", {"running": 3, "waiting": 2, "kv_usage": 0.42}),
    ("sglang", {"running": 5, "waiting": 7, "kv_usage": 0.25}),
    ("tgi", {"running": 6, "waiting": 4}),
    ("llamacpp", {"running": 1, "waiting": 0}),
])
def test_load_from_each_engines_own_metric_names(kind: str, want: dict) -> None:
    assert BACKENDS[kind].load((PAGES / f"{kind}.txt").read_text()) == want


def test_llamacpp_slots() -> None:
    slots = json.loads((PAGES / "llamacpp_slots.json").read_text())
    assert slots_load(slots) == {"running": sum(1 for s in slots if s["is_processing"])}
    assert slots_load([{"id": 0, "state": 1}, {"id": 1, "state": 0}]) == {"running": 1}  # older llama-server


def fake_engine(owned_by: str, metrics: str | None, slots: list | None = None) -> Starlette:
    """What another engine's server answers, as far as the router asks."""
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "smollm2-135m", "object": "model", "owned_by": owned_by}]})

    async def completion(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"id": "c1", "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": owned_by, "finish_reason": "length"}]})

    routes = [Route("/health", lambda r: PlainTextResponse("ok")), Route("/v1/models", models),
              Route("/v1/completions", completion, methods=["POST"])]
    if metrics is not None:
        routes.append(Route("/metrics", lambda r: PlainTextResponse(metrics)))
    if slots is not None:
        routes.append(Route("/slots", lambda r: JSONResponse(slots)))
    return Starlette(routes=routes)


def test_router_fronts_vllm_sglang_tgi_and_llamacpp(procs: list) -> None:
    page = {k: (PAGES / f"{k}.txt").read_text() for k in ("vllm", "sglang", "tgi")}
    slots = json.loads((PAGES / "llamacpp_slots.json").read_text())
    engines = ThreadServers([fake_engine("vllm", page["vllm"]), fake_engine("sglang", page["sglang"]),
                             fake_engine("tgi-model-id", page["tgi"]), fake_engine("llamacpp", None, slots)]).start()
    procs.append(engines)
    vllm, sglang, tgi, llama = engines.urls
    # vLLM and TGI named, SGLang and llama.cpp (no --metrics: load from /slots) detected
    r = router([f"vllm+{vllm}", sglang, f"tgi+{tgi}", llama], "least_load")
    procs.append(r)
    state = wait_state(r.url, lambda s: all(w["model"] and w["healthy"] and w["running"] for w in s["workers"]))
    got = {w["url"]: (w["kind"], w["running"], w["waiting"], w["kv_usage"]) for w in state["workers"]}
    assert got == {vllm: ("vllm", 3, 2, 0.42), sglang: ("sglang", 5, 7, 0.25), tgi: ("tgi", 6, 4, 0.0),
                   llama: ("llamacpp", sum(1 for s in slots if s["is_processing"]), 0, 0.0)}
    import httpx

    served = {httpx.post(r.url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 1},
                         timeout=10).json()["choices"][0]["text"] for _ in range(8)}
    assert served <= {"vllm", "sglang", "tgi-model-id", "llamacpp"} and len(served) > 1
