"""The router's HTTP app: same endpoints and errors as a worker, requests routed by a policy.

Path of a completion request: parse the body (400 if it is not a JSON object), find the workers
serving its model (404 if none does), pass the admission stage (``--flow-control``: wait while the model's
copies are saturated, :mod:`fleetllm.router.pipeline.admission`), tokenize and hash the prompt as the engine
will (prefix-aware policies, and the P/D path), then hand it to the :class:`~fleetllm.router.forward.Forwarder`,
which lets the policy's pipeline choose, counts the load at dispatch, forwards and retries (see
:mod:`fleetllm.router.forward`).
With prefill workers in the group, the first choice may prefill remotely first
(:mod:`fleetllm.disagg.router_path`). With no routable worker the client gets a 503 at once, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.capture.recorder import Capture
from fleetllm.capture.router_tap import RequestTap, open_tap
from fleetllm.disagg.pd_auto import AUTO
from fleetllm.disagg.router_path import RemotePrefill
from fleetllm.observability.dashboard import dashboard_routes
from fleetllm.observability.federate import fleet_metrics
from fleetllm.router.adapters import adapter_bases, adapter_routes
from fleetllm.router.admin import admin_routes
from fleetllm.router.admin_token import read_token
from fleetllm.router.auth import KeyGate
from fleetllm.router.backends import parse_worker
from fleetllm.router.backends.setup import EngineSetup
from fleetllm.router.batches.api import BatchAPI, BatchLimits
from fleetllm.router.batches.inner import OWNER_SCOPE, default_dir, inner_request, read_answer
from fleetllm.router.batches.runner import BatchRunner
from fleetllm.router.batches.store import open_store
from fleetllm.router.config import RouterConfig
from fleetllm.router.forward import Forward, Forwarder, error_response, upstream_headers
from fleetllm.router.guard import guarded
from fleetllm.router.hold import ColdStartHold
from fleetllm.router.index import PrefixIndex
from fleetllm.router.keys import KeyLimiter, KeyRecord, KeyStore
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.pipeline.admission import FlowControl, Ticket
from fleetllm.router.pipeline.filters import Role, Routable, ServesModel
from fleetllm.router.pipeline.shared_flow import SharedFlow
from fleetllm.router.policies import RouteRequest, make_policy, scorer_weights
from fleetllm.router.request_id import HEADER as REQUEST_ID_HEADER
from fleetllm.router.request_id import mint
from fleetllm.router.sessions import ResponseSessions, resend_body
from fleetllm.router.shared_limits import SharedLimiter
from fleetllm.router.shared_turns import SharedTurns
from fleetllm.router.state_url import redact
from fleetllm.router.tenancy import Tenant, TenantMetrics, band, effective_priority, tenant_of
from fleetllm.router.tokens import PromptTokenizer, block_hashes
from fleetllm.router.traffic import TrafficSplit, parse_weights
from fleetllm.router.transport import PerHostTransport
from fleetllm.router.upstream import Breaker, WorkerMonitor, WorkerState
from fleetllm.router.worker_auth import UNKNOWN, Origin, WorkerAuth, origin
from fleetllm.server.anthropic_errors import reshape
from fleetllm.server.body_limit import DEFAULT_MAX_BODY_BYTES
from fleetllm.server.limits import LARGE_INPUT_CHARS, check_inputs, off_loop
from fleetllm.server.openapi import openapi_schema
from fleetllm.server.protocol import BULK_HEADER, APIError, json_object, request_timeout
from fleetllm.server.stored_turns import OWNER_HEADER, normalize_items
from fleetllm.server.worker_secret import matches, worker_secret

log = logging.getLogger(__name__)
TOKENIZER_POLL_S = 0.2  # how often the router looks for a served model whose tokenizer it has not loaded


class Router:
    """The gateway over ``cfg.workers``; ``app`` is the ASGI application."""

    def __init__(self, cfg: RouterConfig, capture: Capture | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.cfg = cfg
        self.capture = capture  # the endpoint and access tiers (fleetllm/capture/)
        self.metrics = RouterMetrics()
        self.workers: list[WorkerState] = []
        self._at: dict[Origin, WorkerState] = {}  # who listens where: the secret goes to fleetllm workers only
        self.engines = EngineSetup(cfg)  # other engines' kinds, vLLM block hashes and KV-event sources
        for i, spec in enumerate(cfg.workers):
            self._add_state(spec, _at(cfg.zones, i, ""), _at(cfg.roles, i, "both"), _at(cfg.models, i, "") or None,
                            _at(cfg.variants, i, ""))
        if len({w.name for w in self.workers}) != len(self.workers):
            raise ValueError("worker URLs must be distinct")
        ttl = cfg.routed_ttl_s if cfg.routed_ttl_s is not None else (300.0 if cfg.policy == "prefix" else 10.0)
        self.index = PrefixIndex(ttl)  # what the policy consults
        # what the workers report (KV events): the kv_aware policy's own index; for other policies it
        # still tells the P/D path how much of a prompt the chosen decode worker holds
        self.events_index = self.index if cfg.policy == "kv_aware" else PrefixIndex(0.0)
        weights = scorer_weights(cfg.scorer_weights)
        self.policy = make_policy(cfg.policy, self.index, cfg.cost, cfg.seed, weights)
        self.model_policies = {m: make_policy(p, self.index, cfg.cost, cfg.seed, weights)
                               for m, p in cfg.model_policies.items()}
        self.uses_prefix = bool({cfg.policy, *cfg.model_policies.values()} & {"prefix", "kv_aware"})
        self.tokens = PromptTokenizer(cfg.tokenizers)
        self.traffic = TrafficSplit({m: parse_weights(spec) for m, spec in cfg.traffic.items()})
        # previous_response_id -> worker; with --state-url also in the store, for the fleet's other routers
        self.shared_turns = SharedTurns(cfg.state_url, cfg.state_namespace) if cfg.state_url else None
        self.sessions = ResponseSessions(cfg.responses_store, self.shared_turns.save if self.shared_turns else None)
        self.hold = ColdStartHold(cfg.hold_max_waiting, cfg.hold_timeout_s)
        self.secret = worker_secret()  # presented to fleetllm workers (fleetllm/router/worker_auth.py)
        # (fleetllm/router/admin_token.py) none configured: only admin keys open the admin routes
        self.admin_token = read_token(cfg.admin_token_file) if cfg.admin_token_file else None
        self._limits_and_flow(cfg)
        self.batches = self._batch_api()
        # these four live while the app runs (they share the HTTP client its lifespan opens)
        self.client: httpx.AsyncClient | None = None
        self.forwarder: Forwarder | None = None
        self.remote_prefill: RemotePrefill | None = None
        self.monitor: WorkerMonitor | None = None
        # discovery sources (fleetllm/router/discovery/): each runs as a task while the app runs
        self.background: list[Callable[[Router], Awaitable[None]]] = []
        if self.cfg.ray_address:  # the fleet's copies are Ray actors: the router finds them itself
            from fleetllm.router.discovery.ray import RayDiscovery

            self.background.append(RayDiscovery(self.cfg.ray_address, self.cfg.ray_namespace).run)
        self.closing = False
        self.app = Starlette(
            routes=self._routes(), lifespan=self._lifespan,
            exception_handlers={APIError: lambda r, e: JSONResponse(e.body(), status_code=e.status, headers=e.headers),
                                404: self._not_found, 405: self._not_found},
        )
        self.app = guarded(self.app, self, max_body_bytes)  # credentials first, then body caps, then the routes

    def _limits_and_flow(self, cfg: RouterConfig) -> None:
        """The keys' gate and limits, per-tenant accounting and flow control, each shared through ``--state-url``."""
        # --state-url: the keys' limits counted in one store for every router (else each router counts alone)
        # (a request's parallel slot is a lease that outlives its longest forward, should this router die)
        self.shared = (SharedLimiter(cfg.state_url, self.metrics.registry, lease_s=cfg.request_timeout_s + 60)
                       if cfg.state_url else None)
        self.gate = (KeyGate(KeyStore(cfg.keys_file), KeyLimiter(), self.metrics.registry, self.shared)
                     if cfg.keys_file else None)
        self.tenants = TenantMetrics(self.metrics.registry)
        # the admission stage (fleetllm/router/pipeline/admission.py): off, requests go to the workers at once
        self.flow = FlowControl(cfg.flow_limits(), self.tenants) if cfg.flow_control else None
        # its tenants' counts shared with the other routers of the store: one flow controller (shared_flow.py)
        self.shared_flow = (SharedFlow(cfg.state_url, cfg.state_namespace)
                            if cfg.flow_control and cfg.state_url else None)

    def _routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.completion, methods=["POST"]),
            Route("/v1/completions", self.completion, methods=["POST"]),
            Route("/v1/messages", self.completion, methods=["POST"]),
            Route("/v1/responses", self.completion, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.forward_any, methods=["POST"]),
            Route("/detokenize", self.forward_any, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/router/state", self.state, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            *self.batches.routes(),
            *admin_routes(self),
            *adapter_routes(self),
            *dashboard_routes(),
        ]

    def _add_state(self, spec: str, zone: str, role: str, model: str | None, variant: str = "") -> WorkerState:
        kind, url = parse_worker(spec)
        w = WorkerState(_name(url), url, zone, role=role, model=model, variant=variant, kind=kind,
                        breaker=Breaker(self.cfg.breaker_threshold, self.cfg.breaker_cooldown_s))
        self.engines.configure(w)
        self.workers.append(w)
        self._at[origin(w.url)] = w
        self.metrics.healthy.labels(worker=w.name, zone=w.zone).set(0)
        self.metrics.breaker_open.labels(worker=w.name).set(0)
        return w

    # ---- membership: the fleet controller adds, drains and removes copies while the router runs -----
    def add_worker(self, url: str, zone: str = "", role: str = "both", model: str | None = None,
                   variant: str = "") -> WorkerState:
        """Add a worker while the router runs; ``url`` may name its engine (``vllm+http://...``)."""
        url = url.rstrip("/")
        if any(w.url == parse_worker(url)[1] for w in self.workers):
            raise APIError(400, f"worker {url} is already known", "url")
        w = self._add_state(url, zone, role, model, variant)
        if self.monitor is not None:
            self.monitor.watch(w)
        return w

    def worker(self, url: str) -> WorkerState:
        w = next((w for w in self.workers if w.url == url.rstrip("/")), None)
        if w is None:
            raise APIError(404, f"no worker {url}", "url")
        return w

    async def remove_worker(self, url: str) -> None:
        w = self.worker(url)
        self.workers.remove(w)
        self._at.pop(origin(w.url), None)
        if self.monitor is not None:
            await self.monitor.unwatch(w)
        self.index.drop(w.name)
        self.metrics.healthy.labels(worker=w.name, zone=w.zone).set(0)

    # ---- credentials: checked by RouterGuard from the headers, before a body is read --------------------
    def require_admin(self, authorization: str | None) -> None:
        """``/admin/*`` and ``/router/state``: the admin token or an admin key; any other valid credential
        (a client key, the workers' secret) is a 403, none a 401."""
        given = (KeyGate.bearer(authorization) or "").encode()
        if matches(given, self.admin_token.encode() if self.admin_token else None):
            return
        rec = self.gate.authenticate(authorization) if self.gate is not None else None
        if rec is not None and rec.admin:
            return
        if rec is not None:
            raise APIError(403, f"key {rec.id} is not an admin key")
        if matches(given, self.secret.encode() if self.secret else None):
            raise APIError(403, "the workers' secret does not open admin endpoints: send the admin token")
        raise APIError(401, "an admin credential is required: send `Authorization: Bearer <admin token>` (the "
                            "file `fleetllm serve` prints) or an admin API key")

    def require_reader(self, authorization: str | None) -> None:
        """``/metrics``: open without keys (as a vLLM server's); with keys, an admin credential or the secret."""
        if self.gate is None:
            return
        given = (KeyGate.bearer(authorization) or "").encode()
        if not matches(given, self.secret.encode() if self.secret else None):
            self.require_admin(authorization)

    def require_key(self, authorization: str | None) -> None:
        """The client API: any live key when keys are on (its model and limits are checked with the body)."""
        if self.gate is not None:
            self.gate.require_live(authorization)

    # ---- the Batch API (fleetllm/router/batches/) ------------------------------------------------------
    def _batch_api(self) -> BatchAPI:
        cfg = self.cfg
        store = open_store(cfg.batch_dir or default_dir())
        runner = BatchRunner(store, self.batch_call, cfg.batch_concurrency, cfg.batch_priority)
        limits = BatchLimits(int(cfg.batch_max_file_mb * 2**20), cfg.batch_max_active, cfg.batch_retention_h)
        return BatchAPI(store, runner, limits, self.owner_of)

    def owner_of(self, request: Request) -> str:
        """Whose files and batches a request may see: its key's id ("" with keys off: one tenant)."""
        return self.gate.require_live(request.headers.get("authorization")).id if self.gate is not None else ""

    async def batch_call(self, path: str, body: dict[str, Any], owner: str) -> tuple[int, Any, str]:
        """One batch line through the client request path, as ``owner``'s request: (status, body, request id)."""
        return await read_answer(await self.completion(inner_request(path, body, owner)), REQUEST_ID_HEADER)

    def _kind_at(self, where: Origin) -> str | None:
        w = self._at.get(where)
        return UNKNOWN if w is None else w.kind

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        auth = WorkerAuth(self.secret, self._kind_at) if self.secret else None  # fleetllm workers answer only us
        verify = ssl.create_default_context(cafile=self.cfg.worker_ca_file) if self.cfg.worker_ca_file else True
        self.client = httpx.AsyncClient(transport=PerHostTransport(verify), timeout=None, auth=auth)
        self.forwarder = Forwarder(self.client, self.cfg, self.metrics, self.index, self.uses_prefix)
        if self.flow is not None:
            self.forwarder.on_load_change = self.flow.kick  # a request ended or went: queues look again
            self.forwarder.has_room = self.flow.has_room
            if self.shared_flow is not None:
                self.shared_flow.start(lambda: self.flow.gates if self.flow is not None else {})
        self.remote_prefill = RemotePrefill(self.client, self.cfg, self.metrics, self.events_index,
                                            on_failure=self.forwarder.failed)
        # the workers' KV events keep the events index exact (it is the policy's index under kv_aware)
        self.monitor = WorkerMonitor(self.workers, self.events_index, self.client, self.cfg.health_interval_s,
                                     on_change=self._on_worker_change)
        await self.monitor.start()  # its workers' first readiness checks answered before the router listens
        if self.capture is not None:
            self.capture.start()
        self.batches.start()  # unfinished batches a previous run left resume now
        tasks = [asyncio.create_task(run(self), name=f"background-{i}") for i, run in enumerate(self.background)]
        if self.uses_prefix:
            tasks.append(asyncio.create_task(self._preload_tokenizers(), name="tokenizers"))
        self._log_state()
        yield
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.batches.runner.stop()  # lines in flight are sent again when a router resumes the batch
        if self.flow is not None:
            await self.flow.close()
        await self.monitor.stop()
        for store in (self.shared, self.shared_turns, self.shared_flow):
            if store is not None:
                await store.close()
        if self.capture is not None:
            await asyncio.to_thread(self.capture.close)  # SIGTERM flushes the capture spool
        await self.client.aclose()

    def _log_state(self) -> None:
        """One line at start: whether this router's limits are shared with the fleet's other routers."""
        if self.cfg.state_url:
            log.info("router state shared through %s: keys' limits hold across every router using it",
                     redact(self.cfg.state_url))
        elif self.gate is not None:
            log.warning("router state is this router's own (no --state-url): each router of the fleet enforces "
                        "the keys' limits alone, so N routers admit up to N times a key's limit")
        else:
            log.info("router state is this router's own (no --state-url)")

    async def _preload_tokenizers(self) -> None:
        """Load each served model's tokenizer once the router knows the model (configured, or a worker's KV events
        snapshot names it), on a thread, before its first request needs it (:meth:`PromptTokenizer.preload`)."""
        while True:
            new = sorted(m for m in self.served_models() if not self.tokens.loaded(m))
            if new:
                await asyncio.to_thread(self.tokens.preload, new)
            await asyncio.sleep(TOKENIZER_POLL_S)

    def _on_worker_change(self, w: WorkerState) -> None:
        self.metrics.healthy.labels(worker=w.name, zone=w.zone).set(1 if w.healthy else 0)
        if not w.healthy:
            self.index.drop(w.name)  # the monitor already dropped the events index's entries
        elif w.model:
            self.hold.ready(w.model)  # requests held for a copy of this model go now

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        e = APIError(404, f"no route {request.method} {request.url.path}")
        return JSONResponse(e.body(), status_code=404)

    # ---- routing ----------------------------------------------------------------------------------
    def served_models(self) -> set[str]:
        """Every model this router serves: configured (even with no copy running) or reported by a worker."""
        return {w.model for w in self.workers if w.model} | set(self.cfg.tokenizers) | set(self.cfg.scale_from_zero)

    def _group(self, model: Any) -> tuple[str | None, list[WorkerState]]:
        """The served name ``model`` stands for (aliases resolved; a LoRA adapter's base model) and the workers
        serving it."""
        served = self.served_models()
        if model is None or not served:
            return None, self.workers
        name = self.cfg.aliases.get(model, model) if isinstance(model, str) else None
        if name not in served and isinstance(name, str):
            name = adapter_bases(self.workers, self.cfg.adapters).get(name, name)
        if name not in served:
            names = ", ".join(sorted(served | set(self.cfg.aliases)))
            adapters = sorted(adapter_bases(self.workers, self.cfg.adapters))
            names += f"; adapters: {', '.join(adapters)}" if adapters else ""
            raise APIError(404, f"The model `{model}` does not exist. Served: {names}", "model")
        return name, ServesModel(name, len(served) == 1).apply(None, self.workers)

    async def _wait_for_copy(self, name: str | None, group: list[WorkerState]) -> float | None:
        """Scale from zero: hold the request until a copy of its model is routable; the seconds held."""
        if name not in self.cfg.scale_from_zero or any(w.routable(time.monotonic()) for w in group):
            return None
        self.metrics.held.labels(model=name).inc()
        try:
            waited = await self.hold.wait(name)
        finally:
            self.metrics.held.labels(model=name).dec()
        self.metrics.cold_start.labels(model=name).observe(waited)
        return waited

    def route_request(self, path: str, body: dict[str, Any], headers: Any, group: list[WorkerState],
                      tokenize: bool = False, name: str | None = None) -> RouteRequest:
        """What the policy sees of a request for served model ``name`` (its adapter, when ``model`` names one)."""
        model = name or body.get("model") or next((w.model for w in group if w.model), None)
        lora = body.get("model") if name is not None and body.get("model") != name else None
        req = RouteRequest(session_key=headers.get(self.cfg.session_header) or _str_or_none(body.get("user")),
                           lora_name=lora)
        if not (self.uses_prefix or tokenize):
            return req
        # fleetllm's hashes at a fleetllm worker's block size (vLLM's hashers have their own)
        bs = next((w.block_size for w in sorted(group, key=lambda w: bool(w.hash_scheme)) if w.block_size), None)
        if model is None or bs is None:
            return req
        ids = self.tokens.token_ids(model, path, body)
        if ids is None:
            return req
        req.num_prompt_tokens, req.block_size = len(ids), bs
        if any(not w.hash_scheme for w in group):
            req.block_hashes = block_hashes(ids, bs, model, lora)
        req.scheme_hashes = self.engines.hashes(ids, {w.hash_scheme for w in group if w.hash_scheme}, lora)
        self.metrics.prompt_tokens.inc(len(ids))
        return req

    async def completion(self, request: Request) -> Response:
        """``/v1/chat/completions`` and ``/v1/completions``: admit, route, forward, relay (and capture)."""
        fid = mint()
        tap = open_tap(self.capture, request, fid)
        if tap is None:
            response = await self._complete(request, fid, None)
        else:
            try:
                response = await self._complete(request, fid, tap)
            except APIError as e:
                response = JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            response = await tap.finish(response)
        return reshape(response) if request.url.path == "/v1/messages" else response

    async def _complete(self, request: Request, fid: str, tap: RequestTap | None) -> Response:
        t0 = time.perf_counter()
        key = None
        try:
            raw = await request.body()
            # a large body parses on a thread (a 16 MiB one takes a fraction of a second: every stream would stall)
            body = json_object(raw) if len(raw) < LARGE_INPUT_CHARS else await off_loop(json_object, raw)
            asked = body.get("priority")
            key, priority = await self._admit(request, body)
            if body.get("priority") != asked:  # clamped to the key's floor: the workers serve it there
                raw = json.dumps(body).encode()
            name, group = self._group(body.get("model"))
            check_inputs(request.url.path, body)
            if request.url.path == "/v1/responses":
                normalize_items(body.get("input"))  # refused here, never stored in the router's sessions
            queued = self._queued(request, body, key, priority)
            held = await self._wait_for_copy(name, group)
            if held is not None:
                name, group = self._group(name)
        except APIError as e:
            if key is not None:
                self.gate.done(key, 0, 0)
            return error_response(self.metrics, e)
        if tap is not None and key is not None:
            tap.key_id = key.id
        if name is not None and body.get("model") != name and body.get("model") in self.cfg.aliases:
            body["model"] = name  # an alias: workers know the served name (an adapter's name they know as it is)
            raw = json.dumps(body).encode()
        self.metrics.model_requests.labels(model=name or "").inc()
        self.tenants.admitted(key, priority)
        try:
            ticket = await self._admission(name, queued)
        except APIError as e:  # shed by flow control
            if key is not None:
                self.gate.done(key, 0, 0)
            return error_response(self.metrics, e, "shed")
        try:
            return await self._forward(request, raw, body, name, group, t0, (key, priority), held, fid, tap, ticket)
        except BaseException:
            if ticket is not None:
                ticket.finished()
            raise
        finally:
            if ticket is not None:
                ticket.dispatched()

    def _queued(self, request: Request, body: dict[str, Any], key: KeyRecord | None,
                priority: int) -> tuple[Tenant, str, float | None] | None:
        """With flow control: whose request it is, its band and its deadline (400 for a bad tenant or timeout)."""
        if self.flow is None:
            return None
        return tenant_of(key, request.headers, body), band(priority), request_timeout(body, request.headers)

    async def _admission(self, name: str | None,
                         queued: tuple[Tenant, str, float | None] | None) -> Ticket | None:
        """The admission stage: through now, or once a copy of the model has room (APIError when shed)."""
        if self.flow is None or queued is None:
            return None
        tenant, priority_band, timeout_s = queued

        def decoders() -> list[WorkerState]:
            group = ServesModel(name, len(self.served_models()) == 1).apply(None, self.workers)
            return Routable(time.monotonic()).apply(None, Role().apply(None, group))

        return await self.flow.admit(name or "", decoders, tenant, priority_band, timeout_s)

    async def _admit(self, request: Request, body: dict[str, Any]) -> tuple[KeyRecord | None, int]:
        """The caller's key (None without keys) and the request's priority as served; 400 / 401 / 403 / 429."""
        if self.gate is None:
            return None, effective_priority(body, None)
        model = body.get("model")
        model = self.cfg.aliases.get(model, model) if isinstance(model, str) else None
        owner = request.scope.get(OWNER_SCOPE)  # a batch line runs as its batch's key
        rec = (self.gate.identify_id(owner, model) if owner is not None
               else self.gate.identify(request.headers.get("authorization"), model))
        priority = effective_priority(body, rec)
        refusal = await self.gate.limit(rec)
        if refusal is not None:
            self.tenants.refused(rec, priority, refusal.reason)
            raise self.gate.refusal_error(refusal)
        return rec, priority

    async def _forward(self, request: Request, raw: bytes, body: dict[str, Any], name: str | None,
                       group: list[WorkerState], t0: float, tenant: tuple[KeyRecord | None, int],
                       held: float | None, fid: str, tap: RequestTap | None, ticket: Ticket | None) -> Response:
        prefill_pool = [w for w in group if w.role == "prefill"]  # the P/D stage's
        group = Role().apply(None, group)
        # --pd-threshold auto without prefill workers: another worker of the model may prefill, when it wins
        peers = not prefill_pool and self.cfg.pd_threshold == AUTO
        tokenize = bool(prefill_pool) or peers
        args = (request.url.path, body, request.headers, group, tokenize, name)
        # tokenising (and a tokenizer's first load) takes a thread: a long prompt never stalls the relayed streams;
        # with nothing to tokenise, no thread (its hop waits its turn behind the relayed streams: milliseconds)
        req = (await asyncio.to_thread(self.route_request, *args) if self.uses_prefix or tokenize
               else self.route_request(*args))
        variant, group = self._variant(name, group, req.session_key or fid)
        # the router's own id (minted at arrival) keys the request; the client's x-request-id travels beside it
        headers = upstream_headers(request.headers, fid, pass_credentials=not (self.secret or self.gate))
        fwd = Forward(request.url.path, raw, body, headers, fid, req, t0)
        if ticket is not None:
            fwd.on_dispatch, fwd.on_finish, fwd.admitted = ticket.dispatched, ticket.finished, ticket.bulk
            if ticket.bulk:  # the worker serves it a level less urgent: an interactive request may take its slot
                fwd.headers[BULK_HEADER] = "1"
        owner = tenant[0].id if tenant[0] is not None else ""
        if owner:  # the workers scope what they keep (stored Responses turns) to the key
            fwd.headers[OWNER_HEADER] = owner
        if variant is not None:
            fwd.variant = (name, variant)
            fwd.response_headers["x-fleetllm-variant"] = variant
        fwd.response_headers[REQUEST_ID_HEADER] = fid  # the client can find its request in captures and logs
        if tap is not None:
            tap.fwd = fwd
            # a stream without usage is captured with the prompt's tokens counted here, only when needed
            tap.count_prompt = lambda: len(self.tokens.token_ids(name, request.url.path, body) or ()) if name else 0
        if request.url.path == "/v1/responses":
            await self._follow_session(fwd, owner)
        if held is not None:
            fwd.response_headers["x-fleetllm-cold-start-ms"] = f"{held * 1000:.0f}"
        self._meter(fwd, tenant)
        assert self.forwarder is not None and self.remote_prefill is not None
        pd = self.remote_prefill
        pool = group if peers else prefill_pool  # (peers: of the variant chosen)
        prepare = (lambda d: pd.maybe_disaggregate(d, fwd, pool)) if pool else None
        policy = self.model_policies.get(name, self.policy) if name else self.policy
        response = await self.forwarder.forward(fwd, group, policy, prepare)
        if fwd.dispatched is not None:
            self.tenants.queued(tenant[0], tenant[1], fwd.dispatched - t0)
        return response

    def _meter(self, fwd: Forward, tenant: tuple[KeyRecord | None, int]) -> None:
        """With keys: the key's tokens and parallel slot are given back, and its tokens counted, once it ends."""
        key, priority = tenant
        if key is None:
            return
        gate, tenants = self.gate, self.tenants

        def on_end(prompt: int, completion: int) -> None:
            gate.done(key, prompt, completion)
            tenants.used(key, priority, prompt, completion)

        fwd.on_end = on_end

    async def _follow_session(self, fwd: Forward, owner: str) -> None:
        """A Responses turn: recorded when answered; a follow-up pinned to its previous turn's worker (a turn
        another router answered comes from the shared state store), one of ``owner``'s turns only."""
        prev_id = fwd.body.get("previous_response_id")
        if self.shared_turns is not None and isinstance(prev_id, str) and self.sessions.get(prev_id, owner) is None:
            turn = await self.shared_turns.load(prev_id)
            if turn is not None:
                self.sessions.put(prev_id, turn)
        fwd.watch = self.sessions.watch(fwd.body, owner)
        prev = self.sessions.get(prev_id, owner)
        if prev is not None:
            body = fwd.body
            fwd.pinned, fwd.resend = prev.worker, lambda: resend_body(body, prev)

    def _variant(self, name: str | None, group: list[WorkerState], key: str) -> tuple[str | None, list[WorkerState]]:
        """A split model's variant for this request and its copies; with no weighted variant up, any copy
        serves (a canary being down must not fail requests)."""
        if name is None or name not in self.traffic.splits:
            return None, group
        now = time.monotonic()
        variant = self.traffic.choose(name, key, {w.variant for w in group if w.routable(now)})
        if variant is None:
            return None, group
        self.metrics.variant_requests.labels(model=name, variant=variant).inc()
        return variant, [w for w in group if w.variant == variant]

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
        """Tokenizer endpoints: any healthy worker answers the same. With keys, ``/tokenize`` is metered as a
        completion is (a request against the key's limits, its tokens as prompt tokens): tokenising costs a
        worker what a prompt does."""
        assert self.client is not None
        key = None
        if request.url.path == "/tokenize" and self.gate is not None:
            key = self.gate.require_live(request.headers.get("authorization"))
            refusal = await self.gate.limit(key)
            if refusal is not None:
                return error_response(self.metrics, self.gate.refusal_error(refusal))
        counted = 0
        try:
            r = await self._tokenizer_call(request)
            if key is not None and r.status_code == 200:
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    counted = int(r.json().get("count", 0))
        finally:
            if key is not None:
                self.gate.done(key, counted, 0)
        if r.status_code >= 500:
            return error_response(self.metrics, APIError(503, "no healthy worker is available; retry later"), "no_worker")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def _tokenizer_call(self, request: Request) -> httpx.Response:
        """The request, tried on the least loaded routable workers; the last answer (503 when none came)."""
        raw = await request.body()
        check_inputs(request.url.path, json_object(raw))
        now = time.monotonic()
        r = httpx.Response(503)
        for w in sorted((w for w in self.workers if w.routable(now)), key=lambda w: w.inflight)[: self.cfg.max_retries + 1]:
            try:
                r = await self.client.post(w.url + request.url.path, content=raw, timeout=10.0,
                                           headers={"content-type": "application/json"})
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                return r
        return r

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_schema("fleetllm router", ("/health", "/metrics", "/router/state")))

    async def health(self, request: Request) -> Response:
        """Liveness and readiness for probes (no credential): a status word, nothing about the workers
        (who they are and where is for admins: ``/router/state``)."""
        ok = any(w.healthy for w in self.workers)
        return JSONResponse({"status": "ok" if ok else "no healthy worker"}, status_code=200 if ok else 503)

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
                   "waiting": w.waiting, "max_num_seqs": w.max_num_seqs, "queued_prefill_tokens": w.queued_prefill_tokens, "kv_usage": w.kv_usage, "model": w.model, "variant": w.variant, "instance": w.instance,
                   "events_connected": w.events_connected, "kind": w.kind, "breaker": w.breaker.state, "draining": w.draining,
                   "index_blocks": self.index.size(w.name), "exact_blocks": len(exact),
                   "adapters": sorted(w.adapters), "resident_adapters": sorted(w.resident_adapters)}
            if with_hashes:
                row["exact_hashes"] = sorted(exact)
            workers.append(row)
        held = {m: n for m, n in self.hold.waiting.items() if n}
        queued = {m: len(g.queue) for m, g in self.flow.gates.items()} if self.flow is not None else {}
        return JSONResponse({"policy": self.policy.name, "pipeline": self.policy.stages(), "workers": workers,
                             "held": held, "queued": queued,
                             "models": sorted(self.served_models()), "traffic": self.traffic.splits})


def _name(url: str) -> str:
    u = urlparse(url if "://" in url else "http://" + url)
    return f"{u.hostname}:{u.port}" if u.port else (u.hostname or url)


def _at(values: list[str], i: int, default: str) -> str:
    return values[i] if i < len(values) else default


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None
