"""Back-pressure is not failure: a full worker's 503 moves the request elsewhere without tripping its
breaker; a full fleet answers 503 with Retry-After; tokenising a prompt never stalls the router's loop."""

from __future__ import annotations

import threading

import httpx
from fleet_helpers import ADMIN, ThreadServer, router, sim_workers, wait_state
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleetllm.router.tokens import PromptTokenizer

QUEUE_FULL = {"error": {"message": "server overloaded: queue full; retry later", "type": "service_unavailable",
                        "param": None, "code": 503}}


def _full_worker() -> Starlette:
    """A worker whose queue is always full (ready, so routable)."""

    async def ok(request):
        return JSONResponse({"status": "ok"})

    async def full(request):
        return JSONResponse(QUEUE_FULL, status_code=503, headers={"Retry-After": "1"})

    return Starlette(routes=[Route("/health", ok), Route("/ready", ok),
                             Route("/v1/completions", full, methods=["POST"])])


def _breakers(url: str) -> list[str]:
    return [w["breaker"] for w in httpx.get(url + "/router/state", headers=ADMIN).json()["workers"]]


def test_a_full_worker_is_skipped_without_tripping_its_breaker(procs) -> None:
    full = ThreadServer(_full_worker()).start()
    procs.append(full)
    sims = sim_workers(1)
    procs.append(sims)
    r = router([full.url, *sims.urls], "round_robin", "--breaker-threshold", "2")
    procs.append(r)
    wait_state(r.url, lambda s: all(w["healthy"] for w in s["workers"]))
    for _ in range(6):
        resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200, resp.text
    assert _breakers(r.url) == ["closed", "closed"]


def test_a_full_fleet_answers_503_with_retry_after(procs) -> None:
    fulls = [ThreadServer(_full_worker()).start() for _ in range(2)]
    procs.extend(fulls)
    r = router([f.url for f in fulls], "round_robin", "--breaker-threshold", "2")
    procs.append(r)
    wait_state(r.url, lambda s: all(w["healthy"] for w in s["workers"]))
    for _ in range(3):
        resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 503 and resp.headers["retry-after"]
        assert resp.json()["error"]["type"] == "service_unavailable"
    assert _breakers(r.url) == ["closed", "closed"]


def test_a_slow_tokenisation_does_not_stall_other_requests(sim, sim_router, monkeypatch) -> None:
    release, entered = threading.Event(), threading.Event()
    original = PromptTokenizer.token_ids

    def slow(self, model, path, body):
        if body.get("prompt") == "slow":
            entered.set()
            release.wait(30)
        return original(self, model, path, body)

    monkeypatch.setattr(PromptTokenizer, "token_ids", slow)
    answers: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answers.append(httpx.post(
        sim_router.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 2}, timeout=60)))
    t.start()
    try:
        assert entered.wait(30)
        # the tokenisation above still blocks: on the event loop, this would time out
        other = httpx.post(sim_router.url + "/v1/completions", json={"prompt": "fast", "max_tokens": 2}, timeout=10)
        assert other.status_code == 200
    finally:
        release.set()
        t.join(30)
    assert answers[0].status_code == 200
