"""The router's HTTP app: same endpoints and errors as a worker, requests routed by a policy.

Path of a completion request: parse the body (400 if it is not a JSON object), find the workers
serving its model (404 if none does), tokenize and hash the prompt as the engine will (prefix-aware
policies, and the P/D path), then hand it to the :class:`~fleetllm.router.forward.Forwarder`, which lets
the policy choose, counts the load at dispatch, forwards and retries (see :mod:`fleetllm.router.forward`).
With prefill workers in the group, the first choice may prefill remotely first
(:mod:`fleetllm.disagg.router_path`). With no routable worker the client gets a 503 at once, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.disagg.router_path import RemotePrefill
from fleetllm.observability.dashboard import dashboard_routes
from fleetllm.observability.federate import fleet_metrics
from fleetllm.router.forward import Forward, Forwarder, error_response, upstream_headers
from fleetllm.router.index import PrefixIndex
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.policies import CostModel, RouteRequest, make_policy
from fleetllm.router.tokens import PromptTokenizer, block_hashes
from fleetllm.router.upstream import Breaker, WorkerMonitor, WorkerState
from fleetllm.server.protocol import APIError, json_object


@dataclass
class RouterConfig:
    """What ``fleetllm router`` takes on its command line (and ``fleetllm serve`` from its config)."""

    workers: list[str]  # base URLs, e.g. http://127.0.0.1:8001
    policy: str = "kv_aware"
    zones: list[str] = field(default_factory=list)  # zone of each worker ("" when unset)
    roles: list[str] = field(default_factory=list)  # role of each worker until its snapshot says (default both)
    pd_threshold: int = 4096  # disaggregate when the decode worker lacks at least this many prompt tokens
    pd_timeout_s: float = 120.0  # remote prefill + transfer; beyond it the request prefills locally
    prefill_max_inflight: int = 2  # a prefill worker with this many remote prefills is saturated
    pd_transfer: str = "auto"  # shm (same host) | http | auto
    max_retries: int = 2
    health_interval_s: float = 1.0
    routed_ttl_s: float | None = None  # routed-prefix hints: default 300 s for prefix, 10 s for kv_aware
    session_header: str = "x-session-id"
    tokenizers: dict[str, str] = field(default_factory=dict)  # served model name -> model reference
    cost: CostModel = field(default_factory=CostModel)
    breaker_threshold: int = 3  # consecutive failures that open a worker's circuit breaker
    breaker_cooldown_s: float = 5.0  # how long it stays open before one probe request
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 600.0
    seed: int | None = None


class Router:
    """The gateway over ``cfg.workers``; ``app`` is the ASGI application."""

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
        # these three live while the app runs (they share the HTTP client its lifespan opens)
        self.client: httpx.AsyncClient | None = None
        self.forwarder: Forwarder | None = None
        self.remote_prefill: RemotePrefill | None = None
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
        self.forwarder = Forwarder(self.client, self.cfg, self.metrics, self.index, self.uses_prefix)
        self.remote_prefill = RemotePrefill(self.client, self.cfg, self.metrics, self.events_index,
                                            on_failure=self.forwarder.failed)
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
        """``/v1/chat/completions`` and ``/v1/completions``: route, forward, relay."""
        t0 = time.perf_counter()
        raw = await request.body()
        try:
            body = json_object(raw)
            group = self._group(body.get("model"))
        except APIError as e:
            return error_response(self.metrics, e)
        prefill_pool = [w for w in group if w.role == "prefill"]
        group = [w for w in group if w.role != "prefill"]
        req = self.route_request(request.url.path, body, request.headers, group, tokenize=bool(prefill_pool))
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        fwd = Forward(request.url.path, raw, body, upstream_headers(request.headers, rid), rid, req, t0)
        assert self.forwarder is not None and self.remote_prefill is not None
        pd = self.remote_prefill
        prepare = (lambda d: pd.maybe_disaggregate(d, fwd, prefill_pool)) if prefill_pool else None
        return await self.forwarder.forward(fwd, group, self.policy, prepare)

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
        return error_response(self.metrics, APIError(503, "no healthy worker is available; retry later"), "no_worker")

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


def _name(url: str) -> str:
    u = urlparse(url if "://" in url else "http://" + url)
    return f"{u.hostname}:{u.port}" if u.port else (u.hostname or url)


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None
