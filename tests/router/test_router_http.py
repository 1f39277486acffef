"""The router over real HTTP: simulated workers, fake upstreams and the router served in-process; worker
processes where a worker is killed or restarted."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fleet_helpers import ADMIN, ThreadServer, router, sim_worker_processes, sim_workers, wait_state
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

SYSTEM = ("You are the assistant of a fleet operator. Answer briefly, cite the runbook section, and never "
          "guess numbers you were not given. The runbook covers routing, caching, failover and capacity.")


def chat(i: int, **kw) -> dict:
    return {"model": "smollm2-135m", "max_tokens": kw.pop("max_tokens", 8),
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}?"}], **kw}


def test_kv_aware_sends_a_returning_prefix_to_the_worker_that_cached_it(procs):
    sims = sim_workers(3)
    procs.append(sims)
    r = router(sims.urls, "kv_aware")
    procs.append(r)
    first = httpx.post(r.url + "/v1/chat/completions", json=chat(0), timeout=30)
    assert first.status_code == 200
    home = first.headers["x-fleetllm-worker"]
    # the worker's stored events reach the router's index
    wait_state(r.url, lambda s: any(w["name"] == home and w["index_blocks"] > 0 for w in s["workers"]))
    for i in range(1, 5):
        resp = httpx.post(r.url + "/v1/chat/completions", json=chat(i), timeout=30)
        assert resp.headers["x-fleetllm-worker"] == home
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    metrics = httpx.get(r.url + "/metrics").text
    assert 'fleetllm_router_decisions_total{policy="kv_aware",reason="affinity"' in metrics
    # the answers' lengths (8 tokens asked; usage says) are what the routing cost now expects of the model's requests
    expected = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith('fleetllm_router_expected_output_tokens{model="smollm2-135m"}'))
    assert 1 <= expected <= 8


def test_round_robin_spreads_requests_over_every_worker(procs):
    sims = sim_workers(3)
    procs.append(sims)
    r = router(sims.urls, "round_robin")
    procs.append(r)
    seen = {httpx.post(r.url + "/v1/chat/completions", json=chat(i), timeout=30).headers["x-fleetllm-worker"]
            for i in range(6)}
    assert len(seen) == 3


def test_router_errors_are_openai_style(procs):
    sims = sim_workers(1)
    procs.append(sims)
    r = router(sims.urls)
    procs.append(r)
    wait_state(r.url, lambda s: all(w["model"] for w in s["workers"]))
    bad = httpx.post(r.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    unknown = httpx.post(r.url + "/v1/chat/completions", json={**chat(0), "model": "gpt-9"})
    assert unknown.status_code == 404 and "gpt-9" in unknown.json()["error"]["message"]
    # the worker's own validation errors pass through unchanged
    neg = httpx.post(r.url + "/v1/chat/completions", json=chat(0, max_tokens=-1))
    assert neg.status_code == 400 and neg.json()["error"]["param"] == "max_tokens"
    assert httpx.get(r.url + "/v1/models").json()["data"][0]["id"] == "smollm2-135m"
    assert httpx.post(r.url + "/tokenize", json={"prompt": "hello"}).json()["count"] >= 1


def test_no_healthy_worker_is_a_prompt_503_not_a_hang(procs):
    from fleet_helpers import free_port

    r = router([f"http://127.0.0.1:{free_port()}"], "kv_aware")  # nothing listens there
    procs.append(r)
    t0 = time.monotonic()
    resp = httpx.post(r.url + "/v1/chat/completions", json=chat(0), timeout=30)
    assert resp.status_code == 503 and resp.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert httpx.get(r.url + "/health").status_code == 503


@pytest.mark.slow
def test_killing_a_worker_mid_run_loses_no_request_that_had_not_started_streaming(procs):
    # real-time timing model: 40 tokens take seconds, so every request is still in flight at the kill
    a, b = sim_worker_processes(1, "--sim-speed", "1"), sim_workers(1, "--sim-speed", "1")
    procs += [a, b]
    r = router([a.url, b.url], "round_robin")
    procs.append(r)
    wait_state(r.url, lambda s: all(w["healthy"] for w in s["workers"]))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(client.post(r.url + "/v1/chat/completions", json=chat(i, max_tokens=40)))
                     for i in range(12)]
            await asyncio.sleep(1.0)
            a.kill()  # SIGKILL: no goodbye
            return await asyncio.gather(*tasks)

    responses = asyncio.run(run())
    assert [x.status_code for x in responses] == [200] * 12  # non-streaming: nothing was sent yet, so retried
    state = wait_state(r.url, lambda s: not next(w for w in s["workers"] if w["url"] == a.url)["healthy"], 10)
    assert next(w for w in state["workers"] if w["url"] == a.url)["index_blocks"] == 0
    after = [httpx.post(r.url + "/v1/chat/completions", json=chat(i), timeout=30) for i in range(4)]
    assert all(x.status_code == 200 and x.headers["x-fleetllm-worker"] == b.url.split("//")[1] for x in after)
    retried = [line for line in httpx.get(r.url + "/metrics").text.splitlines()
               if line.startswith("fleetllm_router_retries_total")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in retried) > 0


@pytest.mark.slow
def test_a_restarted_worker_is_resynced_from_its_snapshot(procs):
    w = sim_worker_processes(1)
    procs.append(w)
    r = router(w.urls, "kv_aware")
    procs.append(r)
    assert httpx.post(r.url + "/v1/chat/completions", json=chat(0), timeout=30).status_code == 200
    before = wait_state(r.url, lambda s: s["workers"][0]["index_blocks"] > 0)["workers"][0]
    port = int(w.url.rsplit(":", 1)[1])
    w.kill()
    w2 = sim_worker_processes(1, port=port)  # same address, new process: empty cache, new instance id
    procs.append(w2)
    after = wait_state(r.url, lambda s: s["workers"][0]["healthy"] and s["workers"][0]["instance"] not in
                       (None, before["instance"]))["workers"][0]
    assert after["index_blocks"] == 0  # nothing of the old cache is believed any more
    resp = httpx.post(r.url + "/v1/chat/completions", json=chat(1), timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# ---- fake upstreams ---------------------------------------------------------------------------------
CHUNKS = [b'data: {"a": 1}\n\n', b'data: {"b": "\xc3\xa9t\xc3\xa9"}\n\n', b"data: [DONE]\n\n"]


def fake_worker(mode: str, gap: float = 0.3, probe_s: float = 0.0) -> Starlette:
    """A minimal upstream: /health ok (after ``probe_s`` seconds: a slow host), no KV events, completions that
    stream CHUNKS (``gap`` seconds apart) or fail."""
    calls = {"n": 0}

    async def health(request):
        await asyncio.sleep(probe_s)
        return JSONResponse({"status": "ok"})

    async def completions(request):
        calls["n"] += 1
        if mode == "fail":
            return JSONResponse({"error": {"message": "boom", "type": "internal_error", "code": 500}}, status_code=500)

        async def gen():
            for c in CHUNKS:
                yield c
                await asyncio.sleep(gap)

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"x-request-id": request.headers["x-request-id"]})

    app = Starlette(routes=[
        Route("/health", health),
        Route("/kv/events", lambda r: Response(status_code=404)),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ])
    app.state.calls = calls
    return app


def test_streaming_through_the_router_is_byte_for_byte_and_chunk_by_chunk(procs):
    with ThreadServer(fake_worker("stream")) as up:
        r = router([up.url], "round_robin")
        procs.append(r)
        arrivals = []
        got = b""
        with httpx.stream("POST", r.url + "/v1/chat/completions", json={"stream": True, "messages": []},
                          headers={"x-request-id": "abc"}, timeout=30) as resp:
            assert resp.headers["x-request-id"] == "abc"
            for chunk in resp.iter_raw():
                got += chunk
                arrivals.append(time.monotonic())
        assert got == b"".join(CHUNKS)
        assert arrivals[-1] - arrivals[0] > 0.4  # relayed as they came, not buffered to the end


def test_a_router_serves_its_first_request_though_its_workers_answer_health_checks_slowly(procs):
    # the worker's health answer takes longer than the router takes to listen (a loaded host): a router that
    # listened before its first round of checks came back answered 503 "no healthy worker" to a healthy fleet
    with ThreadServer(fake_worker("stream", gap=0, probe_s=0.5)) as up:
        r = router([up.url], "round_robin")
        procs.append(r)
        resp = httpx.post(r.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
        assert resp.status_code == 200 and resp.content == b"".join(CHUNKS)


@pytest.mark.slow
def test_a_failing_worker_is_retried_elsewhere_and_its_breaker_opens(procs):
    bad_app = fake_worker("fail")
    with ThreadServer(bad_app) as bad, ThreadServer(fake_worker("stream", gap=0)) as good:
        r = router([bad.url, good.url], "round_robin", "--breaker-cooldown", "600")
        procs.append(r)
        wait_state(r.url, lambda s: all(w["healthy"] for w in s["workers"]))
        for _ in range(10):
            resp = httpx.post(r.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
            assert resp.status_code == 200 and resp.content == b"".join(CHUNKS)
        assert bad_app.state.calls["n"] == 3  # then the breaker stopped sending it requests
        metrics = httpx.get(r.url + "/metrics").text
        assert f'fleetllm_router_breaker_trips_total{{worker="{bad.url[7:]}"}} 1.0' in metrics
        assert f'fleetllm_router_breaker_open{{worker="{bad.url[7:]}"}} 1.0' in metrics
        state = json.loads(httpx.get(r.url + "/router/state", headers=ADMIN).text)
        assert state["workers"][0]["breaker"] == "open"


@pytest.mark.parametrize("policy", ["round_robin", *(pytest.param(p, marks=pytest.mark.slow) for p in ("least_load", "session", "prefix")),
                                    "kv_aware"])
def test_every_policy_serves_requests(procs, policy):
    sims = sim_workers(2)
    procs.append(sims)
    r = router(sims.urls, policy)
    procs.append(r)
    for i in range(3):
        resp = httpx.post(r.url + "/v1/chat/completions", json=chat(i, user="u1"), timeout=30)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]


def kv_snapshot(worker_url: str) -> set[int]:
    """The worker's cached block hashes, from the first event of a fresh /kv/events stream."""
    with httpx.stream("GET", worker_url + "/kv/events", timeout=10) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return set(json.loads(line[6:])["hashes"])
    raise AssertionError("no snapshot")


def test_router_block_hashes_equal_the_engines_after_the_chat_template(procs):
    from fleetllm.router.tokens import PromptTokenizer, block_hashes

    sims = sim_workers(1)
    procs.append(sims)
    body = chat(0, max_tokens=1)
    assert httpx.post(sims.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    ids = PromptTokenizer().token_ids("smollm2-135m", "/v1/chat/completions", body)
    ours = block_hashes(ids, 16, "smollm2-135m")
    assert len(ours) >= 2 and set(ours) <= kv_snapshot(sims.url)


@pytest.mark.slow
def test_the_exact_index_tracks_evictions_on_the_worker(procs):
    sims = sim_workers(1, "--num-blocks", "48")  # ~4 prompts' worth: later prompts evict earlier blocks
    procs.append(sims)
    r = router(sims.urls, "kv_aware")
    procs.append(r)
    wait_state(r.url, lambda s: s["workers"][0]["events_connected"])
    for i in range(10):
        body = {"model": "smollm2-135m", "prompt": f"{i} " + "lorem ipsum dolor sit amet " * 40, "max_tokens": 2}
        assert httpx.post(r.url + "/v1/completions", json=body, timeout=30).status_code == 200
    truth = kv_snapshot(sims.url)
    state = wait_state(r.url, lambda s: s["workers"][0]["exact_blocks"] == len(truth))
    assert 0 < len(truth) <= 48
    assert set(httpx.get(r.url + "/router/state?hashes=1", headers=ADMIN).json()["workers"][0]["exact_hashes"]) == truth
    assert state["workers"][0]["exact_blocks"] == len(truth)


@pytest.mark.slow
def test_sixty_four_simulated_workers_behind_one_router(procs):
    sims = sim_workers(64)
    procs.append(sims)
    r = router(sims.urls, "kv_aware")
    procs.append(r)
    wait_state(r.url, lambda s: all(w["healthy"] and w["events_connected"] for w in s["workers"]), 60)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(r.url + "/v1/chat/completions", json=chat(i)) for i in range(64)))

    responses = asyncio.run(run())
    assert all(x.status_code == 200 for x in responses)
    assert len({x.headers["x-fleetllm-worker"] for x in responses}) > 16  # spread, not piled up
