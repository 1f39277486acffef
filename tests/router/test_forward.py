"""Forwarding and the P/D decision against fake upstreams in-process (httpx mock transport, no sockets)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx

from fleetllm.disagg.handoffs import HEADER as HANDOFF
from fleetllm.disagg.handoffs import WAIT_HEADER
from fleetllm.disagg.router_path import RemotePrefill
from fleetllm.router.forward import Forward, Forwarder
from fleetllm.router.gateway import RouterConfig
from fleetllm.router.index import PrefixIndex
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.policies import Decision, RoundRobin, RouteRequest
from fleetllm.router.upstream import Breaker, WorkerMonitor, WorkerState

Handler = Callable[[httpx.Request], httpx.Response]


class Chunks(httpx.AsyncByteStream):
    """A response body that arrives in pieces, as a worker streams it."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks

    async def __aiter__(self):  # type: ignore[override]
        for c in self.chunks:
            yield c


def workers(*names: str, role: str = "both") -> list[WorkerState]:
    return [WorkerState(n, f"http://{n}", healthy=True, role=role, breaker=Breaker(3, 5.0)) for n in names]


def forwarder(handler: Handler, **cfg: object) -> Forwarder:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return Forwarder(client, RouterConfig(workers=[], **cfg), RouterMetrics(), PrefixIndex(10.0), records_routed=False)


def request(stream: bool = False, prompt_tokens: int = 0) -> Forward:
    body = {"prompt": "hi", "stream": stream}
    return Forward("/v1/completions", b"{}", body, {"x-request-id": "r1"}, "r1",
                   RouteRequest(num_prompt_tokens=prompt_tokens), time.perf_counter())


def no_load(ws: list[WorkerState]) -> bool:
    return all(w.inflight == 0 and w.decoding == 0 and w.pending_prefill_tokens == 0 for w in ws)


def test_a_5xx_before_the_first_byte_is_retried_on_another_worker_and_counted_against_the_first() -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": "broken"}) if r.url.host == "a" else httpx.Response(200, stream=Chunks(b'{"ok": 1}'))

    ws = workers("a", "b")
    resp = asyncio.run(forwarder(handler).forward(request(prompt_tokens=40), ws, RoundRobin()))
    assert resp.status_code == 200 and resp.headers["x-fleetllm-worker"] == "b"
    assert ws[0].breaker.failures == 1 and ws[1].breaker.failures == 0
    assert no_load(ws)


def test_when_every_worker_fails_the_client_gets_the_last_error_body_as_is() -> None:
    ws = workers("a", "b")
    resp = asyncio.run(forwarder(lambda r: httpx.Response(500, content=b'{"e": 1}')).forward(request(), ws, RoundRobin()))
    assert resp.status_code == 500 and resp.body == b'{"e": 1}'
    assert no_load(ws)


def test_with_no_routable_worker_the_answer_is_a_503_at_once() -> None:
    ws = workers("a")
    ws[0].healthy = False
    resp = asyncio.run(forwarder(lambda r: httpx.Response(200)).forward(request(), ws, RoundRobin()))
    assert resp.status_code == 503


def test_a_streamed_response_holds_its_load_until_the_stream_ends() -> None:
    ws = workers("a")
    fw = forwarder(lambda r: httpx.Response(200, stream=Chunks(b"data: 1\n\n", b"data: [DONE]\n\n")))

    async def run() -> tuple[bytes, int]:
        resp = await fw.forward(request(stream=True, prompt_tokens=30), ws, RoundRobin())
        decoding_while_open = ws[0].decoding
        body = b"".join([c async for c in resp.body_iterator])
        return body, decoding_while_open

    body, decoding_while_open = asyncio.run(run())
    assert body == b"data: 1\n\ndata: [DONE]\n\n"
    assert decoding_while_open == 1 and no_load(ws)


def remote_prefill(handler: Handler, **cfg: object) -> tuple[RemotePrefill, list[WorkerState]]:
    failed: list[WorkerState] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    pd = RemotePrefill(client, RouterConfig(workers=[], **cfg), RouterMetrics(), PrefixIndex(0.0), failed.append)
    return pd, failed


def test_a_prompt_below_the_threshold_is_prefilled_locally() -> None:
    pd, _ = remote_prefill(lambda r: httpx.Response(500), pd_threshold=100)
    d = Decision(workers("d")[0], "balance")
    assert asyncio.run(pd.maybe_disaggregate(d, request(prompt_tokens=50), workers("p", role="prefill"))) == d


class Upstreams:
    """Fake workers: each request's URL path, body and headers kept; answers from ``answer``."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response]) -> None:
        self.answer = answer
        self.seen: list[tuple[str, str, dict, dict[str, str]]] = []

    async def __call__(self, r: httpx.Request) -> httpx.Response:
        body = json.loads(r.content) if r.content else {}
        self.seen.append((r.url.host, r.url.path, body, dict(r.headers)))
        await asyncio.sleep(0.01)
        return self.answer(r)

    def posts(self, path: str) -> list[dict]:
        return [b for _, p, b, _ in self.seen if p == path]


def leg_outcome(pd: RemotePrefill, d: Decision, fwd: Forward, pool: list[WorkerState]) -> Decision:
    """The decision, once its remote leg (if one started) has ended."""
    async def run() -> Decision:
        got = await pd.maybe_disaggregate(d, fwd, pool)
        await asyncio.gather(*pd._legs)
        return got

    return asyncio.run(run())


def test_a_remote_prefill_sends_the_request_on_at_once_naming_its_transfer() -> None:
    up = Upstreams(lambda r: httpx.Response(200, json={"bytes": 10, "imported": 12, "already_cached": 0}))
    pd, _ = remote_prefill(up, pd_threshold=100)
    d, pool = Decision(workers("d")[0], "balance"), workers("p", role="prefill")
    got = leg_outcome(pd, d, request(prompt_tokens=200), pool)
    (sent,) = up.posts("/pd/prefill")
    assert got.worker is d.worker and got.headers[HANDOFF] == sent["transfer_id"]
    assert float(got.headers[WAIT_HEADER]) == RouterConfig(workers=[]).pd_timeout_s
    assert got.cached_tokens == 199  # all but the first token, handed over
    assert up.posts("/pd/abandon") == [] and no_load(pool + [d.worker])
    assert pd.metrics.pd_decisions.labels(decision="disaggregated")._value.get() == 1


def test_a_failed_remote_prefill_is_abandoned_on_the_decode_worker_and_blames_the_prefill_worker() -> None:
    up = Upstreams(lambda r: httpx.Response(500, text="boom"))
    pd, failed = remote_prefill(up, pd_threshold=100)
    d, pool = Decision(workers("d")[0], "balance"), workers("p", role="prefill")
    got = leg_outcome(pd, d, request(prompt_tokens=200), pool)
    (sent,) = up.posts("/pd/prefill")
    # the request waiting on the decode worker for this transfer is told to prefill there now
    assert up.posts("/pd/abandon") == [{"transfer_id": sent["transfer_id"]}] == [{"transfer_id": got.headers[HANDOFF]}]
    assert [h for h, path, _, _ in up.seen if path == "/pd/abandon"] == ["d"]
    assert failed == pool and no_load(pool + [d.worker])
    assert pd.metrics.pd_decisions.labels(decision="fallback")._value.get() == 1


def test_a_refused_transfer_does_not_blame_the_prefill_worker() -> None:
    up = Upstreams(lambda r: httpx.Response(502, text="decode refused"))
    pd, failed = remote_prefill(up, pd_threshold=100)
    leg_outcome(pd, Decision(workers("d")[0], "balance"), request(prompt_tokens=200), workers("p", role="prefill"))
    assert failed == [] and len(up.posts("/pd/abandon")) == 1


def test_an_attempt_ended_unanswered_cancels_its_remote_leg_and_an_answered_one_does_not() -> None:
    async def slow(r: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.3)
        return httpx.Response(200, json={"imported": 1})

    async def run(answered: bool) -> tuple[RemotePrefill, list[WorkerState]]:
        pd, _ = remote_prefill(slow, pd_threshold=100)
        pool = workers("p", role="prefill")
        got = await pd.maybe_disaggregate(Decision(workers("d")[0], "balance"), request(prompt_tokens=200), pool)
        await asyncio.sleep(0.05)
        assert pool[0].inflight == 1  # the prefill is under way
        assert got.on_end is not None
        got.on_end(answered)
        await asyncio.gather(*pd._legs, return_exceptions=True)
        return pd, pool

    pd, pool = asyncio.run(run(False))
    assert pd.metrics.pd_decisions.labels(decision="cancelled")._value.get() == 1 and no_load(pool)
    pd, pool = asyncio.run(run(True))
    assert pd.metrics.pd_decisions.labels(decision="disaggregated")._value.get() == 1 and no_load(pool)


def test_a_decisions_headers_go_to_its_worker_only_not_to_a_retry() -> None:
    up = Upstreams(lambda r: httpx.Response(500, json={}) if r.url.host == "a" else httpx.Response(200, stream=Chunks(b"{}")))
    ends: list[bool] = []
    fw = forwarder(up)

    async def prepare(d: Decision) -> Decision:
        return Decision(d.worker, d.reason, 0, {HANDOFF: "t1"}, ends.append)

    resp = asyncio.run(fw.forward(request(), workers("a", "b"), RoundRobin(), prepare))
    assert resp.status_code == 200
    assert [(h, HANDOFF in hdrs) for h, _, _, hdrs in up.seen] == [("a", True), ("b", False)]
    assert ends == [False]  # the attempt on a ended without an answer


def test_a_request_waiting_on_a_worker_that_stopped_answering_health_checks_is_retried_elsewhere() -> None:
    # a node that vanished resets no connection: without this the request would wait out the request timeout
    async def handler(r: httpx.Request) -> httpx.Response:
        if r.url.host == "a":
            await asyncio.sleep(3600)  # frozen, or on a node that is gone
        return httpx.Response(200, stream=Chunks(b'{"ok": 1}'))

    ws = workers("a", "b")

    async def scenario() -> httpx.Response:
        sent = asyncio.create_task(forwarder(handler).forward(request(), ws, RoundRobin()))
        await asyncio.sleep(0.2)
        ws[0].healthy, ws[0].lost = False, 1  # what the monitor does when its health checks go unanswered
        return await asyncio.wait_for(sent, 10)

    resp = asyncio.run(scenario())
    assert resp.status_code == 200 and resp.headers["x-fleetllm-worker"] == "b"
    assert no_load(ws)


def test_only_unanswered_health_checks_lose_a_worker_not_a_drain() -> None:
    # a draining worker answers "not ready" and its in-flight requests finish there
    async def checks(answer: Handler | None, times: int) -> WorkerState:
        async def handler(r: httpx.Request) -> httpx.Response:
            if answer is None:
                raise httpx.ReadTimeout("no answer", request=r)
            return answer(r)

        (w,) = workers("a")
        monitor = WorkerMonitor([w], PrefixIndex(0.0), httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        for _ in range(times):
            await monitor.check(w)
        return w

    silent = asyncio.run(checks(None, 3))
    draining = asyncio.run(checks(lambda r: httpx.Response(503, text="draining"), 3))
    assert not silent.healthy and silent.lost == 1
    assert not draining.healthy and draining.lost == 0
