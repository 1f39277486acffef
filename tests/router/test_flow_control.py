"""The router's admission stage over HTTP (``--flow-control``): requests wait at the router while the worker is
saturated and go on in fair order; a full queue or a passed deadline sheds them in OpenAI's error format with
Retry-After; /metrics shows each tenant's waiting requests and sheds by band; /router/state names the pipeline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from fleet_helpers import ADMIN, ThreadServer, router, sim_workers, wait_state
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from test_shared_limits import ANSWER

FLAGS = ("--flow-control", "--flow-worker-queue", "1", "--flow-queue-max", "3")


class HeldWorker:
    """A fake worker that answers each chat request only once the test lets one through (``release``), and
    records which tenant's request reached it in which order."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.order: list[str] = []
        self.app = Starlette(routes=[Route("/health", lambda r: JSONResponse({"status": "ok"})),
                                     Route("/kv/events", lambda r: Response(status_code=404)),
                                     Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> JSONResponse:
        self.order.append((await request.json()).get("user", ""))
        while not self.permits.acquire(blocking=False):
            await asyncio.sleep(0.005)
        return JSONResponse(ANSWER)

    def release(self, n: int) -> None:
        for _ in range(n):
            self.permits.release()


@pytest.fixture
def fleet() -> Iterator[tuple[str, HeldWorker, ThreadPoolExecutor]]:
    """A flow-controlled router over one held worker (saturated by one request), and a pool to send from."""
    worker = HeldWorker()
    with ThreadServer(worker.app) as up, ThreadPoolExecutor(8) as pool:
        r = router([up.url], "round_robin", *FLAGS)
        wait_state(r.url, lambda s: s["workers"][0]["healthy"])
        try:
            yield r.url, worker, pool
        finally:
            worker.release(100)
            r.stop()


def send(url: str, pool: ThreadPoolExecutor, tenant: str, queued: int | None, priority: int = 0,
         **headers: str) -> Future[httpx.Response]:
    """Send one chat request from ``tenant`` (its ``user``: keys are off); return once the router holds ``queued`` requests in its queue."""
    body = {"messages": [{"role": "user", "content": "hi"}], "priority": priority, "user": tenant}
    fut = pool.submit(httpx.post, url + "/v1/chat/completions", json=body, timeout=30, headers=headers)
    if queued is not None:
        wait_state(url, lambda s: sum(s["queued"].values()) == queued)
    return fut


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics?federate=0").text
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), 0.0)


def test_requests_wait_while_the_worker_is_saturated_and_go_on_alternating_between_tenants(fleet):
    url, worker, pool = fleet
    futures = [send(url, pool, "a", 0)]  # takes the worker's one place
    wait_state(url, lambda s: s["workers"][0]["inflight"] == 1)
    futures += [send(url, pool, "a", 1), send(url, pool, "a", 2), send(url, pool, "b", 3)]
    assert metric(url, "fleetllm_tenant_queued", band="normal") == 3
    worker.release(4)
    assert [f.result().status_code for f in futures] == [200] * 4
    assert worker.order == ["a", "a", "b", "a"]  # first come, first served would be a, a, a, b
    assert metric(url, "fleetllm_tenant_queued", band="normal") == 0


def shed_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status and resp.headers["retry-after"] == "1"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status


def test_a_full_queue_sheds_a_lower_bands_newest_for_an_arrival_else_refuses_the_arrival_with_429(fleet):
    url, worker, pool = fleet
    futures = [send(url, pool, "web", 0)]
    wait_state(url, lambda s: s["workers"][0]["inflight"] == 1)
    batch = [send(url, pool, "batch", 1, priority=5)]
    futures += [send(url, pool, "web", 2), send(url, pool, "web", 3)]
    futures.append(send(url, pool, "web", None))  # the queue is full: the batch request makes room
    shed_error(batch[0].result(), 503)
    shed_error(send(url, pool, "web", None).result(), 429)  # nothing below the normal band to push out
    urgent = send(url, pool, "ops", None, priority=-1)
    shed_error(futures[-1].result(), 503)  # the newest normal request made room for the high band
    worker.release(4)
    assert [f.result().status_code for f in [*futures[:3], urgent]] == [200] * 4
    assert worker.order == ["web", "ops", "web", "web"]
    assert metric(url, "fleetllm_tenant_shed_total", band="low", reason="displaced") == 1
    assert metric(url, "fleetllm_tenant_shed_total", band="normal", reason="queue_full") == 1
    assert metric(url, "fleetllm_tenant_shed_total", band="normal", reason="displaced") == 1


def test_a_request_still_queued_at_its_deadline_gets_503(fleet):
    url, worker, pool = fleet
    first = send(url, pool, "a", 0)
    wait_state(url, lambda s: s["workers"][0]["inflight"] == 1)
    shed_error(send(url, pool, "b", None, **{"x-request-timeout": "0.3"}).result(), 503)
    assert metric(url, "fleetllm_tenant_shed_total", band="normal", reason="deadline") == 1
    worker.release(1)
    assert first.result().status_code == 200 and worker.order == ["a"]


def test_a_tenant_name_over_256_bytes_is_refused_before_it_queues(fleet):
    url, _, _ = fleet
    resp = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers={"x-tenant-id": "t" * 257}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-tenant-id"


def test_the_router_state_names_the_pipeline_and_keeps_each_workers_url_and_health(fleet):
    url, _, _ = fleet
    state = httpx.get(url + "/router/state", headers=ADMIN, timeout=5).json()
    assert state["pipeline"] == {"filters": [], "scorers": {}, "picker": "round_robin"}
    assert state["workers"][0]["url"].startswith("http://127.0.0.1:") and state["workers"][0]["healthy"] is True


def test_a_fleetllm_worker_is_sent_only_what_its_batch_slots_start_and_the_rest_waits_at_the_router():
    sims = sim_workers(1, "--max-num-seqs", "2", "--sim-speed", "2")
    with ThreadPoolExecutor(4) as pool:
        r = router(sims.urls, "least_load", "--flow-control", "--flow-headroom", "0")
        try:
            wait_state(r.url, lambda s: s["workers"][0]["max_num_seqs"] == 2)
            # long enough (~1-2 s each) that all four have arrived while the first two still run, on a loaded host too
            body = {"prompt": "hello there", "max_tokens": 160, "ignore_eos": True, "user": "a"}
            futures = [pool.submit(httpx.post, r.url + "/v1/completions", json=body, timeout=60) for _ in range(4)]
            state = wait_state(r.url, lambda s: sum(s["queued"].values()) == 2)
            held = state["workers"][0]
            assert held["inflight"] == 2 and held["waiting"] == 0  # its queue stays empty: the router holds the rest
            assert [f.result().status_code for f in futures] == [200] * 4
        finally:
            r.stop()
            sims.stop()


def test_a_router_with_a_store_publishes_what_its_tenants_hold_for_the_other_routers(redis_server):
    import redis

    worker, store = HeldWorker(), redis.Redis.from_url(redis_server.url, decode_responses=True)
    with ThreadServer(worker.app) as up, ThreadPoolExecutor(2) as pool:
        r = router([up.url], "round_robin", "--flow-control", "--state-url", redis_server.url,
                   "--state-namespace", "flowtest")
        try:
            wait_state(r.url, lambda s: s["workers"][0]["healthy"])
            held = send(r.url, pool, "team-a", None)
            wait_state(r.url, lambda s: s["workers"][0]["inflight"] == 1)
            deadline = time.monotonic() + 10
            while not (found := [store.hgetall(k) for k in store.scan_iter("fleetllm:flowtest:flow:*")
                                 if store.type(k) == "hash"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            worker.release(1)
            assert held.result().status_code == 200
            assert found == [{"team-a": "1 1"}]
        finally:
            worker.release(10)
            r.stop()


def test_an_interactive_request_takes_the_slot_of_a_flooding_tenants_bulk_request_at_a_priority_worker():
    # 4 slots, one kept from bulk work: tenant a's third request is bulk (past its share of 2 with b counted),
    # filling the last slot but the headroom; b's first takes the headroom, its second a's bulk request's slot
    sims = sim_workers(1, "--max-num-seqs", "4", "--sim-speed", "4", "--scheduling-policy", "priority")
    with ThreadPoolExecutor(5) as pool:
        r = router(sims.urls, "least_load", "--flow-control", "--flow-headroom", "0.25", "--flow-share-window", "0")
        try:
            wait_state(r.url, lambda s: s["workers"][0]["max_num_seqs"] == 4)
            events: list[str] = []

            def post(user: str, max_tokens: int) -> None:
                body = {"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True, "user": user,
                        "stream": True}
                with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=60) as resp:
                    assert resp.status_code == 200
                    for n, _ in enumerate(resp.iter_lines()):
                        if n == 0:
                            events.append(f"{user} first")
                events.append(f"{user} end")

            flood = [pool.submit(post, "a", 400) for _ in range(3)]
            wait_state(r.url, lambda s: s["workers"][0]["inflight"] == 3)
            light = [pool.submit(post, "b", 40) for _ in range(2)]
            for f in light + flood:
                f.result()
            b = [e for e in events if e.startswith("b")]
            assert b[:2] == ["b first", "b first"]  # both ran at once: the second did not wait for the first's end
        finally:
            r.stop()
            sims.stop()
