"""--state-url: two routers over one Redis enforce one key's limits together, and Redis going away never fails
a request (each router falls back to its own limits, says so on /metrics, and shares again once Redis is back).

The routers run in-process over a fast fake upstream; Redis is the session's ``redis-server``.
"""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from fleet_helpers import ThreadServer, router
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.router.keys import KeyStore

ANSWER = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
          "content": "ok"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1,
          "total_tokens": 4}}


def upstream() -> Starlette:
    """Answers every chat request at once; remembers the bodies it was sent."""
    seen: list[dict] = []

    async def chat(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse(ANSWER)

    app = Starlette(routes=[Route("/health", lambda r: JSONResponse({"status": "ok"})),
                            Route("/kv/events", lambda r: Response(status_code=404)),
                            Route("/v1/chat/completions", chat, methods=["POST"])])
    app.state.seen = seen
    return app


@pytest.fixture
def keys(tmp_path):
    store = KeyStore(tmp_path / "keys.yaml")
    return store


def ask(url: str, key: str) -> int:
    return httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers={"authorization": f"Bearer {key}"}, timeout=30).status_code


def degraded(url: str, admin: str) -> float:
    text = httpx.get(url + "/metrics?federate=0", headers={"authorization": f"Bearer {admin}"}).text
    line = next(ln for ln in text.splitlines() if ln.startswith("fleetllm:router_state_degraded "))
    return float(line.split()[1])


def test_two_routers_sharing_a_store_admit_one_keys_rpm_limit_once_not_twice(procs, keys, redis_server):
    rec, key = keys.create("team", rpm_limit=5)
    with ThreadServer(upstream()) as up:
        routers = [router([up.url], "round_robin", "--keys-file", str(keys.path), "--state-url", redis_server.url)
                   for _ in range(2)]
        procs.extend(routers)
        statuses = [ask(routers[i % 2].url, key) for i in range(20)]
    assert statuses.count(200) == 5 and statuses.count(429) == 15
    assert {statuses[i] for i in range(0, 20, 2)} == {200, 429}  # both routers admitted some: one window
    assert {statuses[i] for i in range(1, 20, 2)} == {200, 429}


def test_without_a_store_each_router_admits_the_limit_on_its_own(procs, keys):
    _, key = keys.create("team", rpm_limit=3)
    with ThreadServer(upstream()) as up:
        routers = [router([up.url], "round_robin", "--keys-file", str(keys.path)) for _ in range(2)]
        procs.extend(routers)
        statuses = [ask(routers[i % 2].url, key) for i in range(12)]
    assert statuses.count(200) == 6


def test_redis_down_fails_no_request_and_sets_the_degraded_gauge_until_it_is_back(procs, keys, redis_server):
    rec, key = keys.create("team", rpm_limit=1000)
    _, admin = keys.create("ops", admin=True)
    store = redis.Redis(host="127.0.0.1", port=redis_server.port)
    with ThreadServer(upstream()) as up:
        r = router([up.url], "round_robin", "--keys-file", str(keys.path), "--state-url", redis_server.url)
        procs.append(r)
        assert [ask(r.url, key) for _ in range(3)] == [200] * 3
        assert store.zcard(f"fleetllm:rl:{rec.id}:req") == 3 and degraded(r.url, admin) == 0
        redis_server.kill()
        try:
            assert [ask(r.url, key) for _ in range(10)] == [200] * 10
            assert degraded(r.url, admin) == 1
        finally:
            redis_server.start()  # the same port, empty
        deadline = time.monotonic() + 20
        while degraded(r.url, admin) == 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert degraded(r.url, admin) == 0
        assert ask(r.url, key) == 200
        assert store.zcard(f"fleetllm:rl:{rec.id}:req") == 1  # counted in the store again
    store.close()


def test_parallel_and_token_limits_are_shared_too(redis_server):
    import asyncio

    from prometheus_client import CollectorRegistry

    from fleetllm.router.keys import KeyRecord
    from fleetllm.router.shared_limits import SharedLimiter

    rec = KeyRecord("5e" * 32, tpm_limit=100, max_parallel_requests=2)

    async def run() -> list:
        a, b = (SharedLimiter(redis_server.url, CollectorRegistry()) for _ in range(2))  # two routers
        seen = [await a.admit(rec), await b.admit(rec), await a.admit(rec)]  # the third: 2 already in flight
        a.done(rec, 60)
        b.done(rec, 60)
        await a.drain()
        await b.drain()
        seen.append(await b.admit(rec))  # 120 tokens in the window
        await a.close()
        await b.close()
        return seen

    seen = asyncio.run(run())
    assert seen[:2] == [None, None]
    assert seen[2].reason == "max_parallel_requests" and seen[3].reason == "tpm_limit"
    assert 0 < seen[3].retry_after <= 61  # when the tokens' second leaves the 60 s window
