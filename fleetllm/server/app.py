"""The worker: an OpenAI-compatible HTTP server around one engine (``fleetllm worker``).

Endpoints: /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/models, /tokenize,
/detokenize, /health, /ready, /metrics, and LoRA adapters' /v1/load_lora_adapter and /v1/unload_lora_adapter
(:mod:`.adapters`: a request's ``model`` may name an adapter). Every failure is an OpenAI-style JSON error; a client that goes away
aborts its request, which frees its KV blocks at the engine's next step.

Probes: ``/health`` is liveness (the process and its engine thread are alive: restart me if not);
``/ready`` is readiness (loaded, warm, not draining, engine alive: route to me). A worker whose engine
thread dies fails every in-flight request with a 500 (streams: an error event, then ``[DONE]``),
fails both probes, and calls ``on_fatal`` (``fleetllm worker`` exits non-zero, to be restarted).
On SIGTERM it drains: ``/ready`` answers 503 "draining", new requests get 503 (a router retries them
elsewhere), in-flight ones finish, then it exits.

Handlers parse (:mod:`.protocol`), call the engine (through :class:`AsyncEngine`) and format
(:mod:`.openai_format`). ``request_body``, ``prompt_ids`` and ``until_disconnect`` are public: the
disaggregation endpoints (:mod:`fleetllm.disagg.routes`) handle their requests with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetllm.capture.worker_tap import open_worker_tap
from fleetllm.disagg.config import TransferOptions
from fleetllm.disagg.handoffs import HEADER as HANDOFF_HEADER
from fleetllm.disagg.handoffs import Handoffs, wait_of
from fleetllm.disagg.routes import pd_body_caps, pd_routes
from fleetllm.engine.async_engine import AsyncEngine, EngineFailed, KVEvent
from fleetllm.engine.omp_team import serial_executor
from fleetllm.engine.outputs import RequestOutput
from fleetllm.engine.params import InvalidParameter, SamplingParams, check_params
from fleetllm.engine.scheduler import QueueFull
from fleetllm.kernels.health import details
from fleetllm.kvtier.attach import attach_tiers
from fleetllm.lora.modules import parse_modules
from fleetllm.lora.options import LoraServingOptions
from fleetllm.observability.dashboard import dashboard_routes
from fleetllm.observability.process import ColdStart, ProcessHostCollector
from fleetllm.observability.tracing import trace_id_of
from fleetllm.router import request_id
from fleetllm.server import openai_format as fmt
from fleetllm.server.adapters import Adapters, no_adapter_routes
from fleetllm.server.anthropic import messages_route
from fleetllm.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from fleetllm.server.config import KVEventsOptions, ObservabilityConfig
from fleetllm.server.engine_adapters import EngineAdapters
from fleetllm.server.inflight import InFlight
from fleetllm.server.limits import LARGE_INPUT_CHARS, check_chars, check_inputs, input_chars, number, off_loop
from fleetllm.server.lora_metrics import LoraMetrics
from fleetllm.server.openapi import openapi_schema
from fleetllm.server.protocol import (
    BULK_HEADER,
    APIError,
    bulk_priority,
    chat_messages,
    completion_prompts,
    json_object,
    request_timeout,
    sampling_from_body,
)
from fleetllm.server.responses import ConversationStore, responses_route
from fleetllm.server.structured_fields import constrain, names_constraint
from fleetllm.server.worker_secret import RequireSecret, worker_secret
from fleetllm.store.config import StoreConfig
from fleetllm.tools.config import ToolConfig
from fleetllm.tools.parsers import parser_for
from fleetllm.tools.request import ToolRequest, render_prompt, tool_request
from fleetllm.tools.stream import ToolStream, rewrite_message

if TYPE_CHECKING:
    from fleetllm.capture.recorder import Capture  # its envelope imports cryptography
    from fleetllm.engine.engine import LLMEngine

T = TypeVar("T")
MAX_EVENTS_INTERVAL_S = 3600.0  # /kv/events: the longest a subscriber may go without a load report
request_log = logging.getLogger("fleetllm.requests")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Worker:
    """Request handling for one engine; ``app`` is the ASGI application."""

    def __init__(self, engine: LLMEngine, obs: ObservabilityConfig | None = None, role: str = "both",
                 capture: Capture | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 tools: ToolConfig | None = None, kv_events: KVEventsOptions | None = None,
                 kv_events_index: int = 0, transfer: TransferOptions | None = None, api_key: str | None = None,
                 secret: str | None = None, lora: LoraServingOptions | None = None,
                 store: StoreConfig | None = None) -> None:
        """``secret``: the fleet's (default: :func:`worker_secret`, from the environment); ``api_key``: what a
        client must present (``fleetllm worker --api-key``); with neither, the worker serves anyone. ``lora``,
        ``store``: its LoRA adapters' flags and how it fetches remote ones (with ``--enable-lora``)."""
        self.engine = engine
        self.capture = capture  # the worker tier (fleetllm/capture/)
        self.tool_parser = parser_for((tools or ToolConfig()).tool_call_parser, engine.tokenizer.chat_template)
        self.role = role  # prefill | decode | both (disaggregated serving; routers read it from /kv/events)
        self.async_engine = AsyncEngine(engine, on_failure=self._engine_failed)
        self.adapters = adapters_of(self.async_engine, lora, store)  # LoRA (None without --enable-lora)
        c = engine.config  # KV kept beyond the pool: host memory, disk, a shared Redis
        self.kv_tiers = attach_tiers(engine, c.kv_offload_gb, c.kv_disk_dir, c.kv_disk_gb, c.kv_remote,
                                     c.kv_offload_dtype)
        self.handoffs = Handoffs(engine.blocks)  # prompts prefilled elsewhere, held for their requests (P/D)
        self.kv_publisher = self._kv_publisher(kv_events, kv_events_index)  # vLLM-format KV events (ZMQ), or None
        self._report_tiers()
        self.ready = False  # warm and serving (set at the end of start-up)
        self.draining = False  # SIGTERM: finishing in-flight requests, taking no new ones
        self.on_fatal: Callable[[], None] | None = None  # the engine died: the process should exit non-zero
        self.model_name = engine.model_name
        self.created = int(time.time())
        self.obs = obs or ObservabilityConfig()
        self._observe(engine)
        self.instance_id = uuid.uuid4().hex  # a restarted worker has a new one: routers re-sync their index
        self.closing = False  # set when the server shuts down: ends the endless /kv/events streams
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.readiness, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                *dashboard_routes(),
                Route("/kv/events", self.kv_events, methods=["GET"]),
                *pd_routes(self, transfer),  # transfer: how this worker ships KV frames (P/D)
                messages_route(self),
                responses_route(self, ConversationStore()),
                *(self.adapters.routes() if self.adapters is not None else no_adapter_routes()),
            ],
            lifespan=self._lifespan,
            exception_handlers={APIError: lambda r, e: error_response(e), 404: self._not_found,
                                405: self._not_found, 500: self._internal},
        )
        self.app = self.inflight = InFlight(self.app)
        self.app = BodyLimit(self.app, max_body_bytes, pd_body_caps(engine, max_body_bytes))
        self.secret = secret or worker_secret()  # presented to decode workers too (the P/D path)
        if self.secret or api_key:  # credentials first, before any body is read
            self.app = RequireSecret(self.app, self.secret, api_key)

    def _kv_publisher(self, kv_events: KVEventsOptions | None, index: int) -> Any:
        """KV events in vLLM's format, over ZMQ (after the engine hooked the pool), when configured."""
        if kv_events is None or not kv_events.kv_events_config:
            return None
        from fleetllm.server.kv_publish import VllmEventPublisher

        return VllmEventPublisher(self.engine.pool, kv_events.kv_events_config,
                                  kv_events.prefix_caching_hash_algo, index=index).attach()

    def _observe(self, engine: LLMEngine) -> None:
        """Host metrics, the cold-start phases and, with an OTLP endpoint, request spans and pushed metrics."""
        m, obs = engine.metrics, self.obs
        if m.enabled:
            m.registry.register(ProcessHostCollector(m.labels, gpu=engine.device.startswith("cuda")))
        self.cold_start = ColdStart(m.registry, m.labels)
        self.cold_start.set("weight_load", engine.loaded.load_seconds)
        if engine.loaded.revision:  # a model from the store: its resolve / download / verify / load phases
            for phase, seconds in engine.loaded.phases.items():
                self.cold_start.set(phase, seconds)
            self.cold_start.model_info(engine.loaded.root, engine.loaded.revision)
        self.tracer = self.otlp_metrics = None
        if obs.otlp_endpoint:
            from fleetllm.observability.otlp import OTLPMetricsPusher, resource_for
            from fleetllm.observability.tracing import RequestTracer

            resource = resource_for("fleetllm-worker", m.labels)
            self.tracer = RequestTracer(obs.otlp_endpoint, resource)
            if m.enabled:
                self.otlp_metrics = OTLPMetricsPusher(m.registry, obs.otlp_endpoint, resource, obs.otlp_interval_s)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_default_executor(serial_executor("worker-io"))  # see omp_team
        self.async_engine.start()
        self.cold_start.set("warm_up", await self.async_engine.call(lambda engine: engine.warm_up()))
        if self.capture:
            self.capture.start()
        if self.otlp_metrics:
            self.otlp_metrics.start()
        logging.getLogger("fleetllm").info("worker ready %.1fs after process start", self.cold_start.ready_now())
        self.ready = True
        yield
        self.ready = False
        self.async_engine.shutdown()
        for tier in self.kv_tiers:  # queued disk and Redis writes finished: a restart finds them
            await asyncio.to_thread(tier.close)
        if (pool_file := self.engine.kv_pool_file()) is not None:
            pool_file.close()  # a shared KV pool's file goes with its worker: no prefill worker maps it any more
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.capture:
            await asyncio.to_thread(self.capture.close)  # SIGTERM flushes the capture spool
        if self.otlp_metrics:
            self.otlp_metrics.stop()
        if self.tracer:
            self.tracer.shutdown()

    def _engine_failed(self, err: BaseException) -> None:
        logging.getLogger("fleetllm").error("worker unusable (%s): failing readiness and exiting", err)
        self.closing = True  # ends the /kv/events streams: routers drop this worker's cache at once
        if self.on_fatal is not None:
            self.on_fatal()

    async def drain(self, timeout_s: float) -> bool:
        """Take no new requests and wait up to ``timeout_s`` for in-flight ones; True if all finished."""
        self.draining = True
        logging.getLogger("fleetllm").info("draining: %d request(s) in flight", self.inflight.count)
        if self.async_engine.announce("draining"):  # routers stop sending here on this event, not a poll later
            await asyncio.sleep(0.1)
        idle = await self.inflight.wait_idle(timeout_s)
        if not idle:
            # Out of time: end what is left with an answer rather than a cut connection when the server
            # stops. Not yet answered (queued, or a stream before its first token): a 503 the router retries
            # on another worker; a stream under way ends with that error event and [DONE].
            n = self.async_engine.end_all(APIError(503, "this worker stopped (drain timed out); retry on another",
                                                   headers={"Retry-After": "1"}))
            logging.getLogger("fleetllm").warning("drain timed out with %d request(s) in flight: ended %d",
                                                  self.inflight.count, n)
            await self.inflight.wait_idle(5.0)
        self.closing = True
        return idle

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(404, f"no route {request.method} {request.url.path}"))

    async def _internal(self, request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    # ---- helpers (public ones are what the disaggregation endpoints build on) -------------------------
    async def request_body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object; APIError 400 if it is none, 404 if it names neither the model nor a loaded
        adapter (an adapter's name is kept in ``request.state.lora_name`` for :meth:`served_as` and the run)."""
        raw = await request.body()
        # a large body parses on a thread (a 16 MiB one takes a fraction of a second: every stream would stall)
        body = json_object(raw) if len(raw) < LARGE_INPUT_CHARS else await off_loop(json_object, raw)
        request.state.lora_name = self.lora_for(body.get("model"))
        return body

    def lora_for(self, model: Any) -> str | None:
        """The adapter a request's ``model`` names (None: the base model, or no model); APIError 404 if it names
        neither the base model nor a loaded adapter."""
        if self.adapters is not None:
            return self.adapters.lora_for(model)
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. Served: {self.model_name}", "model")
        return None

    def served_as(self, request: Request) -> str:
        """The name an answer carries as its ``model``: the adapter the request named, else the served model."""
        return getattr(request.state, "lora_name", None) or self.model_name

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def _run(self, request: Request, rid: str, kind: str, prompts: list[list[int]], params: SamplingParams,
                   handoff: str | None = None, handoff_wait_s: float = 0.0) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every (prompt x n) sub-request; yield (choice index, output) as they arrive. ``handoff``: the id
        of the prompt's prefill elsewhere (disaggregated serving), taken over when it is the one sub-request;
        waited for up to ``handoff_wait_s`` first (the router forwards the request while it computes).

        When it ends (finished, failed or abandoned) the request is logged and traced."""
        start = time.monotonic()
        finals: list[RequestOutput] = []
        status = 200
        subs = _sub_requests(request, rid, prompts, params)
        merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        lora = getattr(request.state, "lora_name", None)
        adapter = self.adapters.run_with(lora) if self.adapters is not None and lora else {}
        tap = open_worker_tap(self.capture, request.headers, rid, kind, self.model_name, prompts, params.n,
                              self.engine.tokenizer.decode, lora)

        async def pump(index: int, sub_id: str, ids: list[int], sp: SamplingParams) -> None:
            try:
                # claimed here, where it passes to the engine with no await between: a task cancelled before
                # it ran leaves the handoff to expire, never half taken
                h = await self.handoffs.claim(handoff, len(subs) == 1) if handoff and index == 0 else None
                async for out in self.async_engine.generate(sub_id, ids, sp, start, h, **adapter):
                    await merged.put((index, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await merged.put(e)
            finally:
                await merged.put(None)

        tasks: list[asyncio.Task[None]] = []
        try:
            if handoff and handoff_wait_s > 0:  # its KV (handed over or plainly imported) before any prefill here
                await self.handoffs.wait(handoff, handoff_wait_s)
            tasks = [asyncio.create_task(pump(*s)) for s in subs]
            remaining = len(tasks)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    err = _as_api_error(item)
                    status = err.status if isinstance(err, APIError) else 500
                    raise err
                else:
                    if item[1].finished:
                        finals.append(item[1])
                    if tap:
                        tap.output(*item)
                    yield item
        finally:
            for t in tasks:
                t.cancel()  # a disconnect or error: cancelled generators abort their requests
            if tap:
                tap.end(status)
            self._request_done(request, rid, kind, start, finals, status)

    def run_request(self, request: Request, rid: str, kind: str, prompts: list[list[int]],
                    params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every (choice index, output) of a request as it arrives (the Messages endpoint builds on it)."""
        return self._run(request, rid, kind, prompts, params)

    def _request_done(self, request: Request, rid: str, kind: str, start: float, finals: list[RequestOutput], status: int) -> None:
        """The request's log line and span (the request id ties them to the caller's)."""
        operation = "chat" if kind == "chat" else "text_completion"
        if self.tracer is not None:
            self.tracer.record(rid, request.headers, operation, self.model_name, start, finals, status)
        if self.obs.log_requests and request_log.isEnabledFor(logging.INFO):
            t = finals[0].timing if finals else None
            ttft = f"{t.first_token - t.arrival:.3f}s" if t and t.first_token is not None else "-"
            request_log.info(
                "request %s id=%s %s: status=%d finish=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d ttft=%s e2e=%.3fs trace=%s",
                rid, getattr(request.state, "fleet_id", "-"), operation, status, ",".join(f.finish_reason or "-" for f in finals) or "-",
                finals[0].num_prompt_tokens if finals else 0, sum(f.num_output_tokens for f in finals),
                finals[0].num_cached_tokens if finals else 0, ttft, time.monotonic() - start,
                trace_id_of(request.headers) or "-")

    async def until_disconnect(self, request: Request, aw: Awaitable[T]) -> T:
        """Await ``aw``, cancelling it and raising APIError(499) if the client disconnects meanwhile.

        Used for everything awaited before a response starts (a waiting request has no bytes to send,
        so nothing else would notice that its client left)."""
        task = asyncio.ensure_future(aw)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client disconnected")

    async def _collect(self, agen: AsyncIterator[Any]) -> list[Any]:
        return [it async for it in agen]

    async def collect(self, request: Request, gen: AsyncIterator[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
        """Every output of ``gen`` (from :meth:`run_request`), or APIError 499 if the client leaves first."""
        return await self.until_disconnect(request, self._collect(gen))

    # ---- endpoints ---------------------------------------------------------------------------------
    def prompt_ids(self, kind: str, body: dict[str, Any]) -> list[list[int]]:
        """The token ids of a chat (``kind="chat"``: template applied) or completions request's prompts, checked
        in count and size first (:mod:`.limits`)."""
        if kind != "chat":
            return [self._encode(p) for p in completion_prompts(body)]
        return [self._chat_ids(chat_messages(body), tool_request(body, self.tool_parser), body)]

    async def encoded(self, kind: str, body: dict[str, Any]) -> list[list[int]]:
        """:meth:`prompt_ids`, on a thread for a large input (milliseconds per 10k characters, which on the event
        loop would stall every stream)."""
        if input_chars(body) < LARGE_INPUT_CHARS:
            return self.prompt_ids(kind, body)
        return await off_loop(self.prompt_ids, kind, body)

    def _chat_ids(self, messages: list[dict[str, Any]], tools: ToolRequest, body: dict[str, Any]) -> list[int]:
        try:
            kwargs = body.get("chat_template_kwargs") or {}
            text = render_prompt(self.engine.tokenizer, messages, tools, body.get("add_generation_prompt", True),
                                 **kwargs)
        except Exception as e:
            raise APIError(400, f"chat template failed: {e}", "messages") from None
        return self.engine.tokenizer.encode_pieces(text)  # a resent history: only its new turn is encoded

    async def request_params(self, kind: str, body: dict[str, Any]) -> SamplingParams:
        """The sampling parameters of a chat (``kind="chat"``) or completions request, its output constraint
        (a schema, or the grammar its tools force) compiled."""
        if kind != "chat":
            return await self.constrained(sampling_from_body(body, chat=False), body)
        return await self.constrained(sampling_from_body(body, chat=True), body,
                                      tool_request(body, self.tool_parser).grammar)

    async def chat(self, request: Request) -> Response:
        body = await self.request_body(request)
        check_inputs(request.url.path, body)  # sizes, then parameters, before anything is tokenised
        params = await self.request_params("chat", body)
        ids = await self.encoded("chat", body)
        tools = tool_request(body, self.tool_parser)
        return await self._respond(request, "chat", body, ids, params, tools if tools.parses_calls else None)

    async def constrained(self, params: SamplingParams, body: dict[str, Any], forced: Any = None) -> SamplingParams:
        """``params``, checked against the model (:func:`check_params`), with the request's output constraint,
        compiled off the event loop (a new schema takes milliseconds; building the compiler, at the first
        constrained request, imports torch and llguidance: seconds, tens on a busy host, which on the loop would
        stall every request and health check)."""
        try:
            check_params(params, self.engine.loaded.config.vocab_size)
        except InvalidParameter as e:
            raise APIError(400, str(e), e.param) from None
        if forced is None and not names_constraint(body):  # nothing to compile: no thread's hop (milliseconds
            return params  # behind a running step's hold on the interpreter)
        return await asyncio.to_thread(constrain, params, body, lambda: self.engine.grammars, forced)

    async def completions(self, request: Request) -> Response:
        body = await self.request_body(request)
        if body.get("echo"):
            raise APIError(400, "echo is not supported", "echo")
        check_inputs(request.url.path, body)
        params = await self.request_params("text", body)
        prompts = await self.encoded("text", body)
        return await self._respond(request, "text", body, prompts, params)

    async def _respond(self, request: Request, kind: str, body: dict[str, Any], prompts: list[list[int]],
                       params: SamplingParams, tools: ToolRequest | None = None) -> Response:
        """Run the request and answer it whole or as a stream; with ``tools``, calls in the text become
        ``tool_calls``."""
        if self.draining:
            raise APIError(503, "this worker is draining; retry on another", headers={"Retry-After": "1"})
        # the fleet's id (minted by the router, else here) is unique; the client's id is its own label
        fid = request.headers.get(request_id.HEADER) or request_id.mint()
        rid = request.headers.get("x-request-id") or fid
        cid = ("chatcmpl-" if kind == "chat" else "cmpl-") + fid
        headers = {"x-request-id": rid, request_id.HEADER: fid}
        request.state.fleet_id = fid  # for the request's log line
        timeout = request_timeout(body, request.headers)
        gen = self._run(request, rid, kind, prompts, params, request.headers.get(HANDOFF_HEADER),
                       wait_of(request.headers))
        if timeout is not None:
            gen = _until(gen, time.monotonic() + timeout, timeout)
        try:
            with_ids = return_token_ids(body)
            if not body.get("stream"):
                outs = await self.until_disconnect(request, self._collect(gen))
                resp = fmt.completion_response(kind, cid, self.served_as(request), int(time.time()), outs,
                                               len(prompts) * params.n, params.n, self.token_text,
                                               prompts if with_ids else None)
                if tools is not None:
                    resp["choices"] = [rewrite_message(c, tools.parser) for c in resp["choices"]]
                return JSONResponse(resp, headers=headers)
            # Start the first request before answering 200 so validation errors are still proper JSON errors.
            first = await self.until_disconnect(request, gen.__anext__())
        except APIError as e:
            await gen.aclose()  # aborts whatever is still queued or running
            if e.status == 499:
                return Response(status_code=499)
            raise
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        rewrite = ToolStream(tools.parser).rewrite if tools is not None else None
        return StreamingResponse(self._sse(kind, cid, first, gen, include_usage, params.n, rewrite,
                                           prompts if with_ids else None, self.served_as(request)),
                                 media_type="text/event-stream", headers=headers)

    async def _sse(self, kind: str, cid: str, first: tuple[int, RequestOutput],
                   gen: AsyncIterator[tuple[int, RequestOutput]], include_usage: bool, n: int,
                   rewrite: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None,
                   prompts: list[list[int]] | None = None, model: str = "") -> AsyncIterator[str]:
        created = int(time.time())
        model = model or self.model_name
        counts: dict[int, fmt.TokenCounts] = {}
        try:
            async for index, out in _prepend(first, gen):
                if out.error:
                    yield fmt.error_event(out.error)
                    continue
                opened = index in counts
                counts[index] = fmt.token_counts(out)
                choices = fmt.stream_choices(kind, index, out, not opened, self.token_text, every_token=True)
                if prompts is not None:
                    fmt.add_token_ids(choices, out, prompts[index // n] if not opened else None)
                for choice in choices:
                    for c in rewrite(choice) if rewrite else [choice]:
                        yield fmt.chunk_event(kind, cid, model, created, [c])
            if include_usage:
                yield fmt.chunk_event(kind, cid, model, created, [], fmt.total_usage(counts, n))
            yield fmt.SSE_DONE
        except (APIError, EngineFailed) as e:  # after the 200: the stream ends with an error event
            yield fmt.error_event(str(e), e.status if isinstance(e, APIError) else 500)
            yield fmt.SSE_DONE
        finally:
            await gen.aclose()

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included)."""
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    async def models(self, request: Request) -> Response:
        loaded = self.engine.loaded  # root: where the weights came from; revision: its commit (store models)
        adapters = self.adapters.cards(self.created) if self.adapters is not None else []
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "fleetllm",
             "root": loaded.root or loaded.name, "revision": loaded.revision,
             "max_model_len": self.engine.max_model_len}, *adapters]})

    async def tokenize(self, request: Request) -> Response:
        """A prompt's or chat's token ids; its size checked as a completion's, a large one tokenised on a thread."""
        body = await self.request_body(request)
        tok = self.engine.tokenizer
        if "messages" in body:
            messages = chat_messages(body)
            size = sum(len(m["content"]) for m in messages)
            work = lambda: tok.encode(tok.apply_chat_template(messages, body.get("add_generation_prompt", True)),  # noqa: E731
                                      add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            size = len(body["prompt"])
            check_chars(size, "prompt")
            work = lambda: tok.encode(body["prompt"], bool(body.get("add_special_tokens", True)))  # noqa: E731
        else:
            raise APIError(400, "give prompt (a string) or messages", "prompt")
        ids = await off_loop(work) if size >= LARGE_INPUT_CHARS else work()
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body = await self.request_body(request)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise APIError(400, "tokens must be a list of integers", "tokens")
        check_chars(len(toks), "tokens")
        vocab = self.engine.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in toks):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        work = lambda: self.engine.tokenizer.decode(toks, skip_special_tokens=False)  # noqa: E731
        return JSONResponse({"prompt": await off_loop(work) if len(toks) >= LARGE_INPUT_CHARS else work()})

    async def health(self, request: Request) -> Response:
        """Liveness: the engine thread runs (a draining or warming worker is alive)."""
        if not self.async_engine.is_running:
            return JSONResponse({"status": "engine loop is not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_schema("fleetllm worker", ("/health", "/ready", "/metrics")))

    async def readiness(self, request: Request) -> Response:
        """Readiness: loaded, warm, not draining and the engine alive, with the C kernels it runs; 503 with the
        reason otherwise."""
        if self.async_engine.failure is not None or not self.async_engine.is_running:
            why = "engine failed" if self.async_engine.failure else "engine loop is not running"
        elif self.draining:
            why = "draining"
        elif not self.ready:
            why = "warming up"
        else:  # ready, and which C kernels serve (a missing one is slow, not down: say so, stay routable)
            return JSONResponse({"status": "ready", **details(self.engine.kernels)})
        return JSONResponse({"status": why}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def load(self) -> dict[str, Any]:
        """The worker's load as routers see it (read without locking: a slightly stale view is fine)."""
        sched = self.engine.scheduler
        queued = sched.queued_prefill_tokens()  # a router weighs this queue against the prefix a worker holds
        adapters = self.adapters.report() if self.adapters is not None else {}  # which adapters it holds
        # each KV tier's measured seconds a block (to the microsecond: a report goes out when the load changes)
        measured = {t.medium: round(s, 6) for t in self.kv_tiers if (s := t.load_s_per_block()) is not None}
        return {"running": len(sched.running), "waiting": len(sched.waiting), "queued_prefill_tokens": queued,
                "kv_usage": self.engine.pool.usage, **adapters, **({"tier_load_s": measured} if measured else {})}

    def _report_tiers(self) -> None:
        """Publish the blocks each KV tier keeps and drops, with its medium, on ``/kv/events`` and (when
        configured) in vLLM's format: a router prices a prefix there as a load, not a miss."""
        for tier in self.kv_tiers:
            medium = tier.medium
            self.async_engine.kv_media[medium] = tier.held
            tier.listeners.append(lambda kind, hashes, _ids, m=medium: self.async_engine.publish_kv_event(kind, hashes, m))
            if self.kv_publisher is not None:
                self.kv_publisher.watch_tier(medium, tier.listeners)

    async def kv_events(self, request: Request) -> Response:
        """KV events as a server-sent event stream, for KV-aware routers.

        First a ``snapshot`` (instance id, model, block size, pool size, batch slots (``max_num_seqs``), its
        ``scheduling_policy`` and every cached block hash; ``tiers``: the hashes each KV tier holds, by medium; ``kv_namespace``: the layout a shared tier's blocks are
        stored under), then ``stored`` / ``removed`` events with the hashes of blocks entering or leaving the
        prefix cache (with a ``medium`` when a KV tier's: ``CPU``, ``DISK``, ``SHARED``), ``draining`` once the
        worker takes no new requests, and a ``load`` event (running, waiting, queued prefill tokens, KV usage)
        within 50 ms of a change and at least every ``interval`` seconds.
        Hashes are :func:`fleetllm.engine.block_pool.hash_block` chains keyed by the served model name (and the
        adapter's, :func:`~fleetllm.engine.block_pool.block_key`); a ``stored`` event of blocks computed with
        adapters names each block's adapter in ``lora_names`` (null for the base model's).
        """
        interval = number(request.query_params.get("interval"), "interval", 0.01, MAX_EVENTS_INTERVAL_S, 0.5)
        q, snapshot, media = await self.async_engine.subscribe_kv_events()
        namespace = next((t.namespace for t in self.kv_tiers if t.namespace), None)

        async def stream() -> AsyncIterator[str]:
            try:
                yield fmt.sse_event({"type": "snapshot", "instance": self.instance_id, "model": self.model_name,
                             "block_size": self.engine.pool.block_size, "num_blocks": self.engine.pool.num_blocks,
                             "max_num_seqs": self.engine.scheduler.cfg.max_num_seqs, "role": self.role,
                             "scheduling_policy": self.engine.scheduler.cfg.policy, "hashes": snapshot, "tiers": media, "kv_namespace": namespace, **self.load()})
                # Load goes out as soon as it changes (checked every `poll` s), else every `interval` s: a
                # report left standing after a request ends would make its worker look busy for that long.
                poll, last = min(interval, 0.05), self.load()
                next_check, next_load = time.monotonic() + poll, time.monotonic() + interval
                while not self.closing:
                    try:
                        first = await asyncio.wait_for(q.get(), max(0.0, next_check - time.monotonic()))
                        for kind, hashes, loras, medium in _coalesced(first, q):
                            extra = {"lora_names": loras} if loras else {}  # blocks computed with adapters: their names
                            if medium:
                                extra["medium"] = medium
                            yield fmt.sse_event({"type": kind, "hashes": hashes, **extra})
                    except TimeoutError:
                        pass
                    now = time.monotonic()
                    if now >= next_check:
                        load, next_check = self.load(), now + poll
                        if load != last or now >= next_load:
                            yield fmt.sse_event({"type": "load", **load})
                            last, next_load = load, now + interval
            finally:
                self.async_engine.unsubscribe_kv_events(q)

        return StreamingResponse(stream(), media_type="text/event-stream")


def adapters_of(async_engine: AsyncEngine, lora: LoraServingOptions | None,
                store: StoreConfig | None) -> Adapters | None:
    """The worker's LoRA adapters over its engine's registry; None when the engine takes none."""
    engine = async_engine.engine
    if engine.lora is None:
        return None
    opts = lora or LoraServingOptions()
    adapters = Adapters(EngineAdapters(async_engine), engine.model_name, store, opts.allowed_local_lora_paths,
                        parse_modules(opts.lora_modules, engine.model_name), LoraMetrics(engine))
    adapters.preload()  # --lora-modules: served from the start (one that does not fit: APIError, no start)
    return adapters


def _coalesced(first: KVEvent, q: asyncio.Queue[KVEvent]) -> list[KVEvent]:
    """``first`` and the events queued behind it, runs of one kind and medium (of base-model blocks) merged into
    one event (a tier writes block by block: a long prompt would otherwise be hundreds of events)."""
    out = [(first[0], list(first[1]), first[2], first[3])]
    while not q.empty():
        kind, hashes, loras, medium = q.get_nowait()
        last = out[-1]
        if (kind == last[0] and medium == last[3] and hashes and kind in ("stored", "removed")
                and loras is None and last[2] is None):
            last[1].extend(hashes)
        else:
            out.append((kind, list(hashes), loras, medium))
    return out


def return_token_ids(body: dict[str, Any]) -> bool:
    """vLLM's ``return_token_ids``: the answer carries prompt and output token ids (a boolean, else 400)."""
    value = body.get("return_token_ids")
    if value is not None and not isinstance(value, bool):
        raise APIError(400, "return_token_ids must be a boolean", "return_token_ids")
    return bool(value)


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for it in rest:
        yield it


async def _until(gen: AsyncIterator[T], deadline: float, timeout: float) -> AsyncIterator[T]:
    """``gen``'s items until ``deadline`` (monotonic); past it ``gen`` is cancelled (its requests abort and
    free their blocks) and APIError 408 is raised."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(gen.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            yield item
    except TimeoutError:
        raise APIError(408, f"the request passed its timeout of {timeout:g}s and was aborted", "timeout") from None
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


def _sub_requests(request: Request, rid: str, prompts: list[list[int]],
                  params: SamplingParams) -> list[tuple[int, str, list[int], SamplingParams]]:
    """(choice index, engine request id, prompt ids, sampling) of every prompt x ``n`` choice; a request a router's
    flow control released as bulk work (``x-fleetllm-bulk``) one priority level less urgent."""
    if request.headers.get(BULK_HEADER):
        params = dataclasses.replace(params, priority=bulk_priority(params.priority))
    return [(p_i * params.n + k, f"{rid}-{p_i}-{k}", ids, params.for_choice(k))
            for p_i, ids in enumerate(prompts) for k in range(params.n)]


def _as_api_error(e: BaseException) -> BaseException:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(503, f"server overloaded: {e}; retry later", headers={"Retry-After": "1"})
    if isinstance(e, EngineFailed):
        return APIError(500, str(e))
    if isinstance(e, InvalidParameter):
        return APIError(400, str(e), e.param)
    return e
