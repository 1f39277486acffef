"""Forwarding a request to a worker: load counted at dispatch, retries before the first byte, breaker.

A request's load (in flight, pending prefill tokens, then decoding) is put on its worker the moment it
is dispatched and taken off exactly once, when its response ends however it ends. A failure before
the first byte — connection refused, a 5xx status, a stream that ends before any byte — counts
against the worker's circuit breaker and is retried on another worker (reason ``retry``), up to
``max_retries`` times. A 503 is back-pressure, not failure (a full queue, a draining worker): it is
retried elsewhere the same way but never counts against the breaker, which would otherwise take
capacity away exactly when load peaks; when every worker tried is full the client gets 503 with
``Retry-After``; after the first byte the client owns the stream, and a client that goes away
closes the upstream request, which aborts it on the worker and frees its KV blocks. The response is
relayed byte for byte as the worker sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from fleetllm.router.adapters import holds
from fleetllm.router.index import PrefixIndex
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.pipeline.filters import Routable, Untried
from fleetllm.router.pipeline.output_length import OutputLengths
from fleetllm.router.policies import Decision, Policy, RouteRequest
from fleetllm.router.request_id import HEADER as FLEET_ID_HEADER
from fleetllm.router.sessions import ResponseWatch
from fleetllm.router.upstream import WorkerState
from fleetllm.server.protocol import APIError

if TYPE_CHECKING:
    from fleetllm.router.gateway import RouterConfig

log = logging.getLogger(__name__)

_FORWARD_HEADERS = ("content-type", "authorization", "accept", "traceparent", "tracestate", "x-request-timeout")
_RESPONSE_HEADERS = ("content-type", "x-request-id", FLEET_ID_HEADER)


@dataclass
class Forward:
    """One client request on its way to a worker."""

    path: str  # /v1/chat/completions or /v1/completions
    raw: bytes  # the body as the client sent it: forwarded unchanged
    body: dict[str, Any]  # the same body parsed
    headers: dict[str, str]  # what goes upstream
    rid: str  # the router's own id (request_id.mint()): unique, unlike the client's x-request-id
    route: RouteRequest
    t0: float  # perf_counter at arrival
    response_headers: dict[str, str] = field(default_factory=dict)  # added to the client's answer
    on_end: Callable[[int, int], None] | None = None  # (prompt, completion tokens) once the answer has ended
    variant: tuple[str, str] | None = None  # (model, variant) of a split model: its own metrics
    # a Responses follow-up turn (fleetllm/router/sessions.py): the worker holding its previous turn, the
    # body to send anywhere else instead (the conversation inline), and what records the answer's turn
    pinned: str | None = None
    resend: Callable[[], bytes] | None = None
    watch: ResponseWatch | None = None
    # where and when it went (the access capture tier): chosen worker, routing reason, perf_counter times
    worker: str = ""
    reason: str = ""
    dispatched: float | None = None
    on_dispatch: Callable[[], None] | None = None  # once it reached a worker (the admission stage's ticket)
    on_finish: Callable[[], None] | None = None  # once it ended, however (the ticket gives its tenant's slot back)
    admitted: bool | None = None  # let through by flow control: as bulk work (True) or not; None: no flow control
    first_byte: float | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def ended(self, usage: TokenCount | None) -> None:
        """Report the request's tokens, exactly once (the key gate meters them), and that it ended."""
        if self.on_finish is not None:
            on_finish, self.on_finish = self.on_finish, None
            on_finish()
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            prompt = usage.prompt if usage and usage.prompt else self.route.num_prompt_tokens
            on_end(prompt, usage.completion if usage else 0)


@dataclass
class TokenCount:
    """Tokens of an answer: its ``usage`` when it has one, else (a stream without ``include_usage``) one
    output token per content delta, as fleetllm workers send them (an estimate for other servers)."""

    prompt: int = 0
    completion: int = 0
    _rest: bytes = b""
    _usage: bool = False

    @classmethod
    def of_body(cls, body: bytes) -> TokenCount:
        t = cls()
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            t._take_usage(json.loads(body).get("usage"))
        return t

    def feed(self, chunk: bytes) -> None:
        """One relayed chunk of an SSE stream (events may span chunks)."""
        *events, self._rest = (self._rest + chunk).split(b"\n\n")
        for ev in events:
            at = ev.find(b"data: {")  # Messages API events carry an "event:" line first
            if at < 0:
                continue
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                obj = json.loads(ev[at + 6 :])
                # usage at the top (chat, Messages deltas) or in the object an event carries (Responses)
                usage = obj.get("usage") or (obj.get("response") or obj.get("message") or {}).get("usage")
                if not self._take_usage(usage) and not self._usage:
                    self.completion += sum(1 for c in obj.get("choices", [])
                                           if c.get("text") or (c.get("delta") or {}).get("content"))

    def _take_usage(self, usage: Any) -> bool:
        if not isinstance(usage, dict):
            return False
        if "input_tokens" in usage:  # Messages (cache reads counted apart) and Responses usage
            self.prompt = int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0)
            self.completion, self._usage = int(usage.get("output_tokens", 0)), True
            return True
        if "prompt_tokens" not in usage:
            return False
        self.prompt, self.completion, self._usage = int(usage["prompt_tokens"]), int(usage["completion_tokens"]), True
        return True


def upstream_headers(client_headers: Mapping[str, str], rid: str, pass_credentials: bool = True) -> dict[str, str]:
    """The client's headers a worker needs, plus the ids that tie their logs together: the router's own
    ``rid`` as ``x-fleetllm-request-id`` and the client's ``x-request-id`` (``rid`` when it sent none).

    The client's ``Authorization`` passes only when ``pass_credentials`` (a router with neither keys nor a
    worker secret: a plain proxy); otherwise it never leaves the router, which presents its own secret
    (:mod:`fleetllm.router.worker_auth`)."""
    headers = {k: v for k, v in client_headers.items() if k.lower() in _FORWARD_HEADERS}
    headers["x-request-id"] = client_headers.get("x-request-id") or rid
    headers[FLEET_ID_HEADER] = rid
    if not pass_credentials:
        headers.pop("authorization", None)
    return headers


RETRY_AFTER_S = "1"  # what a client is told to wait when no worker has room


def error_response(metrics: RouterMetrics, e: APIError, kind: str | None = None) -> JSONResponse:
    """``e`` as the client's answer, counted by status (and by ``kind`` among errors when given)."""
    metrics.requests.labels(status=str(e.status)).inc()
    if kind:
        metrics.errors.labels(kind=kind).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class AttemptFailed(Exception):
    """An attempt failed before any byte reached the client: safe to retry elsewhere."""

    def __init__(self, kind: str, message: str, status: int = 502, body: bytes | None = None) -> None:
        super().__init__(message)
        self.kind, self.status, self.body = kind, status, body


Prepare = Callable[[Decision], Awaitable[Decision]]
T = TypeVar("T")


NO_EVENTS_TTL_S = 300.0  # the prefix policy's TTL


class Forwarder:
    """Sends requests to workers over one shared client and keeps their load, breakers and metrics."""

    def __init__(self, client: httpx.AsyncClient, cfg: RouterConfig, metrics: RouterMetrics, index: PrefixIndex,
                 records_routed: bool) -> None:
        self.client = client
        self.cfg = cfg
        self.metrics = metrics
        self.index = index  # the policy's index: learns where a prompt was routed when records_routed
        self.records_routed = records_routed
        self.on_load_change: Callable[[], None] | None = None  # the admission stage looks again
        # with flow control: whether a worker can start one more request (bulk work or not) now (admission's count)
        self.has_room: Callable[[WorkerState, bool], bool] | None = None
        self.lengths = OutputLengths()  # output tokens per answer, by model: what the routing cost expects

    async def forward(self, fwd: Forward, group: list[WorkerState], policy: Policy,
                      prepare: Prepare | None = None) -> Response:
        """Route ``fwd`` with ``policy`` among ``group``, retrying on other workers before the first byte.

        ``prepare`` runs once on the first decision before it is sent (the P/D path's remote prefill)."""
        tried: set[str] = set()
        last: AttemptFailed | None = None
        fwd.route.expected_output_tokens = self.lengths.expected(self._model(fwd), fwd.body)
        fwd.route.urgent = fwd.admitted is False
        for attempt in range(self.cfg.max_retries + 1):
            candidates = Routable(time.monotonic()).apply(fwd.route, Untried(tried).apply(fwd.route, group))
            if not candidates:
                break
            if self.has_room is not None and fwd.admitted is not None:  # released for a free slot: among those with one
                candidates = [w for w in candidates if self.has_room(w, fwd.admitted)] or candidates
            d = _pinned(fwd, candidates) or policy.choose(fwd.route, candidates)
            reason = "retry" if attempt else d.reason
            self.metrics.decisions.labels(policy=policy.name, reason=reason, worker=d.worker.name).inc()
            if fwd.route.lora_name is not None:  # vLLM's lora_name label: sent to a copy holding it, or not
                self.metrics.lora_requests.labels(model=d.worker.model or "", lora_name=fwd.route.lora_name,
                                                  resident=str(holds(d.worker, fwd.route.lora_name)).lower()).inc()
            tried.add(d.worker.name)
            fwd.worker, fwd.reason = d.worker.name, reason
            if attempt == 0 and prepare is not None:
                d = await prepare(d)
            try:
                return await self._attempt(fwd, d)
            except AttemptFailed as f:
                last = f
                self.metrics.errors.labels(kind=f.kind).inc()
                self.metrics.retries.labels(worker=d.worker.name).inc()
                log.warning("request %s failed on %s before its first byte (%s): %s", fwd.rid, d.worker.name, f.kind, f)
        fwd.ended(None)
        resp = self._give_up(last)
        self._count_variant(fwd, resp.status_code)
        return resp

    def _count_variant(self, fwd: Forward, status: int, ttfb: float | None = None) -> None:
        """A split model's per-variant answer count (and time to first byte, when a worker answered)."""
        if fwd.variant is None:
            return
        model, variant = fwd.variant
        if ttfb is not None:
            self.metrics.variant_ttfb.labels(model=model, variant=variant).observe(ttfb)
        self.metrics.variant_responses.labels(model=model, variant=variant, status=str(status)).inc()

    def _give_up(self, last: AttemptFailed | None) -> Response:
        busy = {"Retry-After": RETRY_AFTER_S}
        if last is None:
            return error_response(self.metrics, APIError(503, "no healthy worker is available; retry later",
                                                         headers=busy), "no_worker")
        if last.body is not None and last.status < 600:
            self.metrics.requests.labels(status=str(last.status)).inc()
            return Response(last.body, status_code=last.status, media_type="application/json",
                            headers=busy if last.status == 503 else None)
        return error_response(self.metrics, APIError(last.status if last.status in (502, 503, 504) else 502,
                                                     f"every worker tried failed; last error: {last}"), "all_failed")

    async def _attempt(self, fwd: Forward, d: Decision) -> Response:
        w = d.worker
        load = _Load(self, w, d.uncached_tokens(fwd.route), fwd.route.num_prompt_tokens, d.on_end,
                     bulk=fwd.admitted is True)
        self._dispatch(w, load.uncached, fwd.route)
        w.bulk_inflight += load.bulk
        fwd.dispatched = time.perf_counter()
        if fwd.on_dispatch is not None:
            fwd.on_dispatch()
        resp, chunks, first = await self._first_byte(fwd, w, load, d.headers)
        fwd.first_byte = time.perf_counter()
        load.first_byte()
        w.breaker.success()
        self._sync_breaker(w)
        self.metrics.ttfb.observe(time.perf_counter() - fwd.t0)
        self._count_variant(fwd, resp.status_code, time.perf_counter() - fwd.t0)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() in _RESPONSE_HEADERS}
        out_headers.update(fwd.response_headers, **{"x-fleetllm-worker": w.name})
        status = resp.status_code
        self.metrics.requests.labels(status=str(status)).inc()
        if not fwd.stream or status != 200:
            try:
                rest = [c async for c in chunks]
            except httpx.HTTPError as e:
                self.metrics.errors.labels(kind="body_broken").inc()
                rest, status = [], 502
                first = json.dumps(APIError(502, f"the worker's response broke: {e}").body()).encode()
            finally:
                await resp.aclose()
                load.release()
            body = first + b"".join(rest)
            count = TokenCount.of_body(body)
            if status == 200:
                self._answered(fwd, count.completion)
            fwd.ended(count)
            if fwd.watch is not None:
                fwd.watch.body(body)
                fwd.watch.finish(w.name, status)
            return Response(body, status_code=status, headers=out_headers)
        return StreamingResponse(self._relay(fwd, first, chunks, resp, load), status_code=status, headers=out_headers)

    async def _first_byte(self, fwd: Forward, w: WorkerState, load: _Load,
                          headers: dict[str, str]) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        """Send the request (with ``headers`` for ``w`` only) and wait for its first byte; on failure release the
        load and raise AttemptFailed."""
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=self.cfg.connect_timeout_s)
        try:
            resp = await _unless_lost(w, self.client.send(
                self.client.build_request("POST", w.url + fwd.path, content=fwd.raw,
                                          headers={**fwd.headers, **headers}, timeout=timeout),
                stream=True))
        except (httpx.HTTPError, WorkerLost) as e:
            load.release()
            self.failed(w)
            raise AttemptFailed("connect", f"{type(e).__name__}: {e}") from None
        if resp.status_code >= 500:
            body = await _read_quietly(resp)
            load.release()
            if resp.status_code == 503:  # full or draining: try elsewhere, but the worker is not failing
                w.breaker.busy()
            else:
                self.failed(w)
            raise AttemptFailed(f"upstream_{resp.status_code}", body[:200].decode(errors="replace"), resp.status_code,
                                body)
        chunks = resp.aiter_raw()
        try:
            first = await _unless_lost(w, chunks.__anext__())
        except (httpx.HTTPError, StopAsyncIteration, WorkerLost) as e:
            await resp.aclose()
            load.release()
            self.failed(w)
            raise AttemptFailed("no_first_byte", f"the response ended before its first byte ({type(e).__name__})") from None
        return resp, chunks, first

    async def _relay(self, fwd: Forward, first: bytes, chunks: AsyncIterator[bytes], resp: httpx.Response,
                     load: _Load) -> AsyncIterator[bytes]:
        count = TokenCount()  # the answer's tokens: metered, and what the routing cost expects of the next ones
        watch = fwd.watch
        try:
            yield first
            count.feed(first)
            if watch:
                watch.feed(first)
            async for c in chunks:
                yield c
                count.feed(c)
                if watch:
                    watch.feed(c)
            self._answered(fwd, count.completion)
        except httpx.HTTPError as e:
            self.metrics.errors.labels(kind="stream_broken").inc()
            err = APIError(502, f"the worker's stream broke: {type(e).__name__}").body()
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await resp.aclose()  # on a client disconnect this closes the upstream request: the worker aborts
            load.release()
            fwd.ended(count)
            if watch:
                watch.finish(load.worker.name, resp.status_code)

    @staticmethod
    def _model(fwd: Forward) -> str:
        model = fwd.body.get("model")
        return model if isinstance(model, str) else ""

    def _answered(self, fwd: Forward, output_tokens: int) -> None:
        """An answer ended whole with ``output_tokens``: the routing cost's expectation of its model learns it."""
        model = self._model(fwd)
        self.metrics.expected_output.labels(model=model).set(self.lengths.observe(model, output_tokens))

    def _dispatch(self, w: WorkerState, uncached: int, req: RouteRequest) -> None:
        w.dispatched()
        w.pending_prefill_tokens += uncached
        w.inflight_tokens += req.num_prompt_tokens
        w.breaker.on_dispatch()
        hashes = req.hashes_for(w)
        if self.records_routed and hashes:
            if w.num_blocks:
                self.index.capacity.setdefault(w.name, w.num_blocks)
            # an engine without KV events never confirms: remember its prefixes as long as the prefix policy does
            self.index.record_routed(w.name, hashes, None if w.reports_kv else NO_EVENTS_TTL_S)
        self.metrics.cached_tokens.inc(max(0, req.num_prompt_tokens - uncached))
        self.metrics.zone_requests.labels(zone=w.zone).inc()
        self.load_changed(w)

    def load_changed(self, w: WorkerState) -> None:
        """Export ``w``'s router-side load after it changed, and note it in its time averages."""
        now, window = time.monotonic(), self.cfg.cost.load_window_s
        w.streams_avg.note(w.inflight, now, window)
        w.tokens_avg.note(w.inflight_tokens, now, window)
        self.metrics.inflight.labels(worker=w.name).set(w.inflight)
        self.metrics.pending_prefill.labels(worker=w.name).set(w.pending_prefill_tokens)
        if self.on_load_change is not None:
            self.on_load_change()

    def failed(self, w: WorkerState) -> None:
        """Count a failure of ``w`` against its circuit breaker."""
        if w.breaker.failure(time.monotonic()):
            self.metrics.breaker_trips.labels(worker=w.name).inc()
            log.warning("circuit breaker open for %s (%d failures)", w.name, w.breaker.failures)
        self._sync_breaker(w)

    def _sync_breaker(self, w: WorkerState) -> None:
        self.metrics.breaker_open.labels(worker=w.name).set(1 if w.breaker.state == "open" else 0)


LOST_CHECK_S = 0.5  # how often a request waiting for its first byte looks whether its worker was lost


class WorkerLost(Exception):
    """The worker stopped answering health checks while a request waited for its first byte."""


async def _unless_lost(w: WorkerState, aw: Awaitable[T]) -> T:
    """``aw``, unless ``w`` is taken out of rotation for not answering health checks first: then it is cancelled
    (closing its connection, which aborts it on the worker if the worker still listens) and WorkerLost raised,
    so the request is retried elsewhere. A node that vanished resets no connection (a frozen worker neither),
    and the request would otherwise wait out the whole request timeout with no answer."""
    lost = w.lost
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LOST_CHECK_S)
            if done:
                return task.result()
            if w.lost != lost:
                raise WorkerLost(f"{w.name} stopped answering health checks")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class _Load:
    """The load one attempt puts on its worker: pending prefill until the first byte, then decoding."""

    def __init__(self, forwarder: Forwarder, w: WorkerState, uncached: int, tokens: int,
                 on_end: Callable[[bool], None] | None = None, bulk: bool = False) -> None:
        self.forwarder, self.worker, self.uncached, self.on_end = forwarder, w, uncached, on_end
        self.tokens = tokens  # the request's prompt tokens (counted in the worker's inflight_tokens)
        self.bulk = bulk  # released by flow control as bulk work (counted in the worker's bulk_inflight)
        self.first_seen = False

    def first_byte(self) -> None:
        self.first_seen = True
        self.worker.pending_prefill_tokens -= self.uncached
        self.worker.decoding += 1

    def release(self) -> None:
        w = self.worker
        w.inflight -= 1
        w.inflight_tokens -= self.tokens
        w.bulk_inflight -= self.bulk
        w.ended_since_report += 1
        if self.first_seen:
            w.decoding -= 1
        else:
            w.pending_prefill_tokens -= self.uncached
        self.forwarder.load_changed(w)
        if self.on_end is not None:
            self.on_end(self.first_seen)


def _pinned(fwd: Forward, candidates: list[WorkerState]) -> Decision | None:
    """A Responses follow-up goes to the worker holding its previous turn while that one is routable and
    untried; otherwise it becomes a self-contained request (conversation inline) for the policy to place."""
    if fwd.pinned is None:
        return None
    w = next((w for w in candidates if w.name == fwd.pinned), None)
    if w is not None:
        return Decision(w, "affinity")
    log.info("request %s: worker %s of its previous response is gone; re-sending the conversation",
             fwd.rid, fwd.pinned)
    fwd.pinned = None
    if fwd.resend is not None:
        fwd.raw, fwd.resend = fwd.resend(), None
    return None


async def _read_quietly(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await resp.aclose()
