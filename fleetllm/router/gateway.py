"""The router's HTTP app: same endpoints and errors as a worker, requests routed by a policy.

Path of a completion request: parse the body (400 if it is not a JSON object), find the workers
serving its model (404 if none does), tokenize and hash the prompt as the engine will (prefix-aware
policies only), let the policy choose, count the load at dispatch, and forward. The response is
relayed byte for byte as the worker sends it. A failure before the first byte — connection refused,
a 5xx status, a stream that ends before any byte — is retried on another worker (reason ``retry``),
up to ``max_retries`` times; after the first byte the client owns the stream, and a client that goes
away closes the upstream request, which aborts it on the worker and frees its KV blocks. With no
routable worker the client gets a 503 at once, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetllm.observability.dashboard import dashboard_routes
from fleetllm.observability.federate import fleet_metrics
from fleetllm.router.config import RouterConfig
from fleetllm.router.index import PrefixIndex
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.policies import Decision, RouteRequest, make_policy
from fleetllm.router.tokens import PromptTokenizer, block_hashes
from fleetllm.router.upstream import Breaker, WorkerMonitor, WorkerState
from fleetllm.server.protocol import APIError

log = logging.getLogger(__name__)

_FORWARD_HEADERS = ("content-type", "authorization", "accept", "traceparent", "tracestate")
_RESPONSE_HEADERS = ("content-type", "x-request-id")


class _Failure(Exception):
    """An attempt failed before any byte reached the client: safe to retry elsewhere."""

    def __init__(self, kind: str, message: str, status: int = 502, body: bytes | None = None) -> None:
        super().__init__(message)
        self.kind, self.status, self.body = kind, status, body


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        zones = cfg.zones or [""] * len(cfg.workers)
        urls = [(u if "://" in u else "http://" + u).rstrip("/") for u in cfg.workers]
        roles = cfg.roles or ["both"] * len(urls)
        self.workers = [WorkerState(_name(u), u, zones[i] if i < len(zones) else "",
                                    role=roles[i] if i < len(roles) else "both",
                                    breaker=Breaker(cfg.breaker_threshold, cfg.breaker_cooldown_s))
                        for i, u in enumerate(urls)]
        if len({w.name for w in self.workers}) != len(self.workers):
            raise ValueError("worker URLs must be distinct")
        ttl = cfg.routed_ttl_s if cfg.routed_ttl_s is not None else (300.0 if cfg.policy == "prefix" else 10.0)
        self.index = PrefixIndex(ttl)  # what the policy consults
        # what the workers report (KV events): the kv_aware policy's own index; for other policies it
        # still tells the P/D path how much of a prompt the chosen decode worker holds
        self.events_index = self.index if cfg.policy == "kv_aware" else PrefixIndex(0.0)
        self.policy = make_policy(cfg.policy, self.index, cfg.cost, cfg.seed)
        self.uses_prefix = cfg.policy in ("prefix", "kv_aware")
        self.tokens = PromptTokenizer(cfg.tokenizers)
        self.metrics = RouterMetrics()
        self.client: httpx.AsyncClient | None = None
        self.monitor: WorkerMonitor | None = None
        self.closing = False
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.completion, methods=["POST"]),
                Route("/v1/completions", self.completion, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/tokenize", self.forward_any, methods=["POST"]),
                Route("/detokenize", self.forward_any, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/router/state", self.state, methods=["GET"]),
                *dashboard_routes(),
            ],
            lifespan=self._lifespan,
            exception_handlers={APIError: lambda r, e: JSONResponse(e.body(), status_code=e.status),
                                404: self._not_found, 405: self._not_found},
        )
        for w in self.workers:
            self.metrics.healthy.labels(worker=w.name, zone=w.zone).set(0)
            self.metrics.breaker_open.labels(worker=w.name).set(0)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(limits=limits, timeout=None)
        # the workers' KV events keep the events index exact (it is the policy's index under kv_aware)
        self.monitor = WorkerMonitor(self.workers, self.events_index, self.client, self.cfg.health_interval_s,
                                     on_change=self._on_worker_change)
        self.monitor.start()
        yield
        await self.monitor.stop()
        await self.client.aclose()

    def _on_worker_change(self, w: WorkerState) -> None:
        self.metrics.healthy.labels(worker=w.name, zone=w.zone).set(1 if w.healthy else 0)
        if not w.healthy:
            self.index.drop(w.name)  # the monitor already dropped the events index's entries

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        e = APIError(404, f"no route {request.method} {request.url.path}")
        return JSONResponse(e.body(), status_code=404)

    # ---- routing ----------------------------------------------------------------------------------
    def _group(self, model: Any) -> list[WorkerState]:
        """The workers serving ``model`` (every worker while none has reported its model yet)."""
        known = {w.model for w in self.workers if w.model}
        if model is None or not known:
            return self.workers
        if not isinstance(model, str) or model not in known:
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(sorted(known))}", "model")
        return [w for w in self.workers if w.model == model or w.model is None]

    def route_request(self, path: str, body: dict[str, Any], headers: Any, group: list[WorkerState],
                      tokenize: bool = False) -> RouteRequest:
        req = RouteRequest(session_key=headers.get(self.cfg.session_header) or _str_or_none(body.get("user")))
        if not (self.uses_prefix or tokenize):
            return req
        model = body.get("model") or next((w.model for w in group if w.model), None)
        bs = next((w.block_size for w in group if w.block_size), None)
        if model is None or bs is None:
            return req
        ids = self.tokens.token_ids(model, path, body)
        if ids is None:
            return req
        req.num_prompt_tokens, req.block_size = len(ids), bs
        req.block_hashes = block_hashes(ids, bs, model)
        self.metrics.prompt_tokens.inc(len(ids))
        return req

    async def completion(self, request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return self._error(APIError(400, f"malformed JSON body: {e}"))
        if not isinstance(body, dict):
            return self._error(APIError(400, "the request body must be a JSON object"))
        try:
            group = self._group(body.get("model"))
        except APIError as e:
            return self._error(e)
        prefill_pool = [w for w in group if w.role == "prefill"]
        group = [w for w in group if w.role != "prefill"]
        req = self.route_request(request.url.path, body, request.headers, group, tokenize=bool(prefill_pool))
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        headers["x-request-id"] = rid
        stream = bool(body.get("stream"))
        tried: set[str] = set()
        last: _Failure | None = None
        for attempt in range(self.cfg.max_retries + 1):
            now = time.monotonic()
            candidates = [w for w in group if w.name not in tried and w.routable(now)]
            if not candidates:
                break
            d = self.policy.choose(req, candidates)
            reason = "retry" if attempt else d.reason
            self.metrics.decisions.labels(policy=self.policy.name, reason=reason, worker=d.worker.name).inc()
            tried.add(d.worker.name)
            if attempt == 0 and prefill_pool:
                d = await self._maybe_disaggregate(d, req, prefill_pool, request.url.path, body, rid)
            try:
                return await self._attempt(request, d, req, raw, headers, stream, t0)
            except _Failure as f:
                last = f
                self.metrics.errors.labels(kind=f.kind).inc()
                self.metrics.retries.labels(worker=d.worker.name).inc()
                log.warning("request %s failed on %s before its first byte (%s): %s", rid, d.worker.name, f.kind, f)
        if last is None:
            return self._error(APIError(503, "no healthy worker is available; retry later"), kind="no_worker")
        if last.body is not None and last.status < 600:
            self.metrics.requests.labels(status=str(last.status)).inc()
            return Response(last.body, status_code=last.status, media_type="application/json")
        return self._error(APIError(last.status if last.status in (502, 503, 504) else 502,
                                    f"every worker tried failed; last error: {last}"), kind="all_failed")

    async def _maybe_disaggregate(self, d: Decision, req: RouteRequest, prefill_pool: list[WorkerState], path: str,
                                  body: dict[str, Any], rid: str) -> Decision:
        """The P/D path: with the decode worker chosen, prefill remotely if it lacks enough of the prompt.

        The decode worker's load is counted from here on. Whatever goes wrong on the remote leg (prefill
        worker down, transfer refused, timeout), the request goes on with a local prefill: counted, and
        invisible to the client."""
        held = self.events_index.match(req.block_hashes, [d.worker.name])[d.worker.name] * req.block_size
        if held > d.cached_tokens:
            d = Decision(d.worker, d.reason, min(held, max(req.num_prompt_tokens - 1, 0)))
        uncached = d.uncached_tokens(req)
        if uncached < self.cfg.pd_threshold:
            self.metrics.pd_decisions.labels(decision="local").inc()
            return d
        now = time.monotonic()
        free = [w for w in prefill_pool if w.routable(now) and w.inflight < self.cfg.prefill_max_inflight]
        if not free:
            self.metrics.pd_decisions.labels(decision="saturated").inc()
            return d
        p = min(free, key=lambda w: (w.inflight, w.pending_prefill_tokens))
        via = self.cfg.pd_transfer
        if via == "auto":
            via = "shm" if _host(p.url) == _host(d.worker.url) else "http"
        assert self.client is not None
        t0 = time.perf_counter()
        d.worker.inflight += 1  # load counted at dispatch, including while its KV is being prepared elsewhere
        p.inflight += 1
        p.pending_prefill_tokens += uncached
        try:
            r = await self.client.post(p.url + "/pd/prefill", json={
                "path": path, "body": body, "decode_url": d.worker.url, "transfer": via, "request_id": rid,
                "timeout_s": self.cfg.pd_timeout_s}, headers={"x-request-id": rid},
                timeout=httpx.Timeout(self.cfg.pd_timeout_s, connect=self.cfg.connect_timeout_s))
            ok = r.status_code == 200
            detail = r.json() if ok else r.text[:200]
            # 502 = the prefill worker did its part but the decode worker refused or was unreachable
            prefill_at_fault = not ok and r.status_code != 502
        except (httpx.HTTPError, ValueError) as e:
            ok, detail, prefill_at_fault = False, f"{type(e).__name__}: {e}", True
        finally:
            d.worker.inflight -= 1
            p.inflight -= 1
            p.pending_prefill_tokens -= uncached
        if not ok:
            self.metrics.pd_decisions.labels(decision="fallback").inc()
            self.metrics.errors.labels(kind="pd_prefill_failed").inc()
            if prefill_at_fault:
                self._failed(p)
            log.warning("request %s: remote prefill on %s failed (%s); prefilling on %s", rid, p.name, detail,
                        d.worker.name)
            return d
        p.breaker.success()
        self.metrics.pd_decisions.labels(decision="disaggregated").inc()
        self.metrics.pd_seconds.observe(time.perf_counter() - t0)
        self.metrics.pd_bytes.inc(detail.get("bytes", 0))
        shipped = (detail.get("imported", 0) + detail.get("already_cached", 0)) * req.block_size
        cached = min(max(d.cached_tokens, shipped), max(req.num_prompt_tokens - 1, 0))
        return Decision(d.worker, d.reason, cached)

    async def _attempt(self, request: Request, d: Decision, req: RouteRequest, raw: bytes, headers: dict[str, str],
                       stream: bool, t0: float) -> Response:
        w = d.worker
        uncached = d.uncached_tokens(req)
        self._dispatch(w, uncached, req)
        first_seen = False

        def release() -> None:
            w.inflight -= 1
            if first_seen:
                w.decoding -= 1
            else:
                w.pending_prefill_tokens -= uncached
            self._update_load_metrics(w)

        assert self.client is not None
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=self.cfg.connect_timeout_s)
        try:
            resp = await self.client.send(
                self.client.build_request("POST", w.url + request.url.path, content=raw, headers=headers, timeout=timeout),
                stream=True)
        except httpx.HTTPError as e:
            release()
            self._failed(w)
            raise _Failure("connect", f"{type(e).__name__}: {e}") from None
        if resp.status_code >= 500:
            body = await _read_quietly(resp)
            release()
            self._failed(w)
            raise _Failure(f"upstream_{resp.status_code}", body[:200].decode(errors="replace"), resp.status_code, body)
        chunks = resp.aiter_raw()
        try:
            first = await chunks.__anext__()
        except (httpx.HTTPError, StopAsyncIteration) as e:
            await resp.aclose()
            release()
            self._failed(w)
            raise _Failure("no_first_byte", f"the response ended before its first byte ({type(e).__name__})") from None
        first_seen = True
        w.pending_prefill_tokens -= uncached
        w.decoding += 1
        w.breaker.success()
        self._sync_breaker(w)
        self.metrics.ttfb.observe(time.perf_counter() - t0)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() in _RESPONSE_HEADERS}
        out_headers["x-fleetllm-worker"] = w.name
        status = resp.status_code
        self.metrics.requests.labels(status=str(status)).inc()
        if not stream or status != 200:
            try:
                rest = [c async for c in chunks]
            except httpx.HTTPError as e:
                self.metrics.errors.labels(kind="body_broken").inc()
                rest, status = [], 502
                first = json.dumps(APIError(502, f"the worker's response broke: {e}").body()).encode()
            finally:
                await resp.aclose()
                release()
            return Response(first + b"".join(rest), status_code=status, headers=out_headers)
        return StreamingResponse(self._relay(first, chunks, resp, release), status_code=status, headers=out_headers)

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], resp: httpx.Response, release: Any) -> AsyncIterator[bytes]:
        try:
            yield first
            async for c in chunks:
                yield c
        except httpx.HTTPError as e:
            self.metrics.errors.labels(kind="stream_broken").inc()
            err = APIError(502, f"the worker's stream broke: {type(e).__name__}").body()
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await resp.aclose()  # on a client disconnect this closes the upstream request: the worker aborts
            release()

    def _dispatch(self, w: WorkerState, uncached: int, req: RouteRequest) -> None:
        w.inflight += 1
        w.pending_prefill_tokens += uncached
        w.breaker.on_dispatch()
        if self.uses_prefix and req.block_hashes:
            if w.num_blocks:
                self.index.capacity.setdefault(w.name, w.num_blocks)
            self.index.record_routed(w.name, req.block_hashes)
        self.metrics.cached_tokens.inc(max(0, req.num_prompt_tokens - uncached))
        self.metrics.zone_requests.labels(zone=w.zone).inc()
        self._update_load_metrics(w)

    def _update_load_metrics(self, w: WorkerState) -> None:
        self.metrics.inflight.labels(worker=w.name).set(w.inflight)
        self.metrics.pending_prefill.labels(worker=w.name).set(w.pending_prefill_tokens)

    def _failed(self, w: WorkerState) -> None:
        if w.breaker.failure(time.monotonic()):
            self.metrics.breaker_trips.labels(worker=w.name).inc()
            log.warning("circuit breaker open for %s (%d failures)", w.name, w.breaker.failures)
        self._sync_breaker(w)

    def _sync_breaker(self, w: WorkerState) -> None:
        self.metrics.breaker_open.labels(worker=w.name).set(1 if w.breaker.state == "open" else 0)

    def _error(self, e: APIError, kind: str | None = None) -> JSONResponse:
        self.metrics.requests.labels(status=str(e.status)).inc()
        if kind:
            self.metrics.errors.labels(kind=kind).inc()
        return JSONResponse(e.body(), status_code=e.status)

    # ---- other endpoints --------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        assert self.client is not None
        healthy = [w for w in self.workers if w.healthy]

        async def one(w: WorkerState) -> list[dict[str, Any]]:
            try:
                r = await self.client.get(w.url + "/v1/models", timeout=3.0)
                return r.json()["data"] if r.status_code == 200 else []
            except (httpx.HTTPError, ValueError, KeyError):
                return []

        merged: dict[str, dict[str, Any]] = {}
        for data in await asyncio.gather(*(one(w) for w in healthy)):
            for m in data:
                merged.setdefault(m["id"], m)
        return JSONResponse({"object": "list", "data": list(merged.values())})

    async def forward_any(self, request: Request) -> Response:
        """Tokenizer endpoints: any healthy worker answers the same."""
        assert self.client is not None
        raw = await request.body()
        now = time.monotonic()
        for w in sorted((w for w in self.workers if w.routable(now)), key=lambda w: w.inflight)[: self.cfg.max_retries + 1]:
            try:
                r = await self.client.post(w.url + request.url.path, content=raw,
                                           headers={"content-type": "application/json"}, timeout=10.0)
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        return self._error(APIError(503, "no healthy worker is available; retry later"), kind="no_worker")

    async def health(self, request: Request) -> Response:
        body = {"status": "ok" if any(w.healthy for w in self.workers) else "no healthy worker",
                "workers": [{"name": w.name, "url": w.url, "healthy": w.healthy, "zone": w.zone} for w in self.workers]}
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        """The router's own series, then every worker's re-exported with ``worker=<name>`` (one scrape
        target per fleet); ``?federate=0`` for the router's own only."""
        own = generate_latest(self.metrics.registry).decode()
        if request.query_params.get("federate") == "0" or self.client is None:
            return Response(own, media_type=CONTENT_TYPE_LATEST)
        body = await fleet_metrics(own, {w.name: w.url for w in self.workers}, self.client)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def state(self, request: Request) -> Response:
        """Every worker as the router sees it (for people and tests); ``?hashes=1`` adds the exact index."""
        with_hashes = request.query_params.get("hashes") == "1"
        workers = []
        for w in self.workers:
            exact = self.events_index.exact.get(w.name, set())
            row = {"name": w.name, "url": w.url, "zone": w.zone, "role": w.role, "healthy": w.healthy, "inflight": w.inflight,
                   "pending_prefill_tokens": w.pending_prefill_tokens, "decoding": w.decoding, "running": w.running,
                   "waiting": w.waiting, "kv_usage": w.kv_usage, "model": w.model, "instance": w.instance,
                   "events_connected": w.events_connected, "breaker": w.breaker.state,
                   "index_blocks": self.index.size(w.name), "exact_blocks": len(exact)}
            if with_hashes:
                row["exact_hashes"] = sorted(exact)
            workers.append(row)
        return JSONResponse({"policy": self.policy.name, "workers": workers})


async def _read_quietly(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await resp.aclose()


def _name(url: str) -> str:
    u = urlparse(url if "://" in url else "http://" + url)
    return f"{u.hostname}:{u.port}" if u.port else (u.hostname or url)


def _host(url: str) -> str:
    h = urlparse(url).hostname or ""
    return "127.0.0.1" if h == "localhost" else h


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None
