"""The worker: an OpenAI-compatible HTTP server around one engine (``fleetllm worker``).

Endpoints: /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/models, /tokenize,
/detokenize, /health, /metrics. Every failure is an OpenAI-style JSON error; a client that goes away
aborts its request, which frees its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetllm.disagg.routes import pd_routes
from fleetllm.engine.async_engine import AsyncEngine
from fleetllm.engine.outputs import RequestOutput
from fleetllm.engine.params import InvalidParameter, SamplingParams
from fleetllm.engine.scheduler import QueueFull
from fleetllm.observability.dashboard import dashboard_routes
from fleetllm.observability.process import ColdStart, ProcessHostCollector
from fleetllm.observability.tracing import trace_id_of
from fleetllm.server.config import ObservabilityConfig
from fleetllm.server.protocol import APIError, chat_messages, completion_prompts, sampling_from_body

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine

T = TypeVar("T")
request_log = logging.getLogger("fleetllm.requests")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Worker:
    """Request handling for one engine; ``app`` is the ASGI application."""

    def __init__(self, engine: LLMEngine, obs: ObservabilityConfig | None = None, role: str = "both") -> None:
        self.engine = engine
        self.role = role  # prefill | decode | both (disaggregated serving; routers read it from /kv/events)
        self.async_engine = AsyncEngine(engine)
        self.model_name = engine.model_name
        self.created = int(time.time())
        self.obs = obs = obs or ObservabilityConfig()
        m = engine.metrics
        if m.enabled:
            m.registry.register(ProcessHostCollector(m.labels, gpu=engine.device.startswith("cuda")))
        self.cold_start = ColdStart(m.registry, m.labels)
        self.cold_start.set("weight_load", engine.loaded.load_seconds)
        self.tracer = self.otlp_metrics = None
        if obs.otlp_endpoint:
            from fleetllm.observability.otlp import OTLPMetricsPusher, resource_for
            from fleetllm.observability.tracing import RequestTracer

            resource = resource_for("fleetllm-worker", m.labels)
            self.tracer = RequestTracer(obs.otlp_endpoint, resource)
            if m.enabled:
                self.otlp_metrics = OTLPMetricsPusher(m.registry, obs.otlp_endpoint, resource, obs.otlp_interval_s)
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
                Route("/metrics", self.metrics, methods=["GET"]),
                *dashboard_routes(),
                Route("/kv/events", self.kv_events, methods=["GET"]),
                *pd_routes(self),
            ],
            lifespan=self._lifespan,
            exception_handlers={APIError: lambda r, e: error_response(e), 404: self._not_found,
                                405: self._not_found, 500: self._internal},
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.cold_start.set("warm_up", self.engine.warm_up())
        self.async_engine.start()
        if self.otlp_metrics:
            self.otlp_metrics.start()
        logging.getLogger("fleetllm").info("worker ready %.1fs after process start", self.cold_start.ready_now())
        yield
        self.async_engine.shutdown()
        if self.otlp_metrics:
            self.otlp_metrics.stop()
        if self.tracer:
            self.tracer.shutdown()

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(404, f"no route {request.method} {request.url.path}"))

    async def _internal(self, request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    # ---- helpers -----------------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. Served: {self.model_name}", "model")
        return body

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def _run(self, request: Request, rid: str, kind: str, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every (prompt x n) sub-request; yield (choice index, output) as they arrive.

        When it ends (finished, failed or abandoned) the request is logged and traced."""
        start = time.monotonic()
        finals: list[RequestOutput] = []
        status = 200
        subs = []
        for p_i, ids in enumerate(prompts):
            for k in range(params.n):
                sub = replace(params, n=1, seed=None if params.seed is None else params.seed + k)
                subs.append((p_i * params.n + k, f"{rid}-{p_i}-{k}", ids, sub))
        merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, sub_id: str, ids: list[int], sp: SamplingParams) -> None:
            try:
                async for out in self.async_engine.generate(sub_id, ids, sp, start):
                    await merged.put((index, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await merged.put(e)
            finally:
                await merged.put(None)

        tasks = [asyncio.create_task(pump(*s)) for s in subs]
        try:
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
                    yield item
        finally:
            for t in tasks:
                t.cancel()  # a disconnect or error: cancelled generators abort their requests
            self._request_done(request, rid, kind, start, finals, status)

    def _request_done(self, request: Request, rid: str, kind: str, start: float, finals: list[RequestOutput], status: int) -> None:
        """The request's log line and span (the request id ties them to the caller's)."""
        operation = "chat" if kind == "chat" else "text_completion"
        if self.tracer is not None:
            self.tracer.record(rid, request.headers, operation, self.model_name, start, finals, status)
        if self.obs.log_requests and request_log.isEnabledFor(logging.INFO):
            t = finals[0].timing if finals else None
            ttft = f"{t.first_token - t.arrival:.3f}s" if t and t.first_token is not None else "-"
            request_log.info(
                "request %s %s: status=%d finish=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d ttft=%s e2e=%.3fs trace=%s",
                rid, operation, status, ",".join(f.finish_reason or "-" for f in finals) or "-",
                finals[0].num_prompt_tokens if finals else 0, sum(f.num_output_tokens for f in finals),
                finals[0].num_cached_tokens if finals else 0, ttft, time.monotonic() - start,
                trace_id_of(request.headers) or "-")

    async def _until_disconnect(self, request: Request, aw: Awaitable[T]) -> T:
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

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- endpoints ---------------------------------------------------------------------------------
    def prompt_ids(self, kind: str, body: dict[str, Any]) -> list[list[int]]:
        """The token ids of a chat (``kind="chat"``: template applied) or completions request's prompts."""
        if kind != "chat":
            return [self._encode(p) for p in completion_prompts(body)]
        messages = chat_messages(body)
        try:
            kwargs = body.get("chat_template_kwargs") or {}
            text = self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.get("add_generation_prompt", True), **kwargs
            )
        except Exception as e:
            raise APIError(400, f"chat template failed: {e}", "messages") from None
        return [self.engine.tokenizer.encode(text, add_special_tokens=False)]

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        ids = self.prompt_ids("chat", body)
        params = sampling_from_body(body, chat=True)
        return await self._respond(request, "chat", body, ids, params)

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        if body.get("echo"):
            raise APIError(400, "echo is not supported", "echo")
        prompts = self.prompt_ids("text", body)
        params = sampling_from_body(body, chat=False)
        return await self._respond(request, "text", body, prompts, params)

    async def _respond(self, request: Request, kind: str, body: dict[str, Any], prompts: list[list[int]], params: SamplingParams) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        cid = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
        headers = {"x-request-id": rid}
        gen = self._run(request, rid, kind, prompts, params)
        try:
            if not body.get("stream"):
                outs = await self._until_disconnect(request, self._collect(gen))
                return JSONResponse(self._full_response(kind, cid, outs, len(prompts) * params.n, params.n),
                                    headers=headers)
            # Start the first request before answering 200 so validation errors are still proper JSON errors.
            first = await self._until_disconnect(request, gen.__anext__())
        except APIError as e:
            await gen.aclose()  # aborts whatever is still queued or running
            if e.status == 499:
                return Response(status_code=499)
            raise
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._sse(kind, cid, first, gen, include_usage, params.n), media_type="text/event-stream", headers=headers)

    async def _sse(self, kind: str, cid: str, first: tuple[int, RequestOutput], gen: AsyncIterator[tuple[int, RequestOutput]], include_usage: bool, n: int) -> AsyncIterator[str]:
        created = int(time.time())
        counts: dict[int, tuple[int, int, int]] = {}
        started: set[int] = set()

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            obj = {"id": cid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                   "created": created, "model": self.model_name, "choices": choices}
            if usage is not None:
                obj["usage"] = usage
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        async def items() -> AsyncIterator[tuple[int, RequestOutput]]:
            yield first
            async for it in gen:
                yield it

        try:
            async for index, out in items():
                if out.error:
                    yield f"data: {json.dumps(APIError(500, out.error).body())}\n\n"
                    continue
                counts[index] = (out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
                if kind == "chat":
                    if index not in started:
                        started.add(index)
                        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                    if out.new_text or out.logprobs:
                        yield chunk([{"index": index, "delta": {"content": out.new_text},
                                      "logprobs": self._chat_logprobs(out), "finish_reason": None}])
                    if out.finished:
                        yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": _finish(out),
                                      "stop_reason": out.stop_reason}])
                else:
                    if out.new_text or out.finished or out.logprobs:
                        yield chunk([{"index": index, "text": out.new_text, "logprobs": self._text_logprobs(out, 0),
                                      "finish_reason": _finish(out) if out.finished else None,
                                      "stop_reason": out.stop_reason if out.finished else None}])
            if include_usage:
                yield chunk([], self._sum_usage(counts, n))
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()

    def _sum_usage(self, counts: dict[int, tuple[int, int, int]], n: int) -> dict[str, Any]:
        """Usage over all choices: each prompt's tokens count once even with n > 1, as in OpenAI's API."""
        firsts = [c for i, c in counts.items() if i % n == 0]
        return self._usage(sum(p for p, _, _ in firsts), sum(o for _, o, _ in counts.values()),
                           sum(c for _, _, c in firsts))

    def _full_response(self, kind: str, cid: str, outs: list[tuple[int, RequestOutput]], num_choices: int, n: int) -> dict[str, Any]:
        texts = [""] * num_choices
        lps: list[list[Any]] = [[] for _ in range(num_choices)]
        final: dict[int, RequestOutput] = {}
        for index, out in outs:
            if out.error:
                raise APIError(500, out.error)
            texts[index] += out.new_text
            if out.logprobs:
                lps[index].append(out)
            if out.finished:
                final[index] = out
        choices = []
        for i in range(num_choices):
            f = final[i]
            if kind == "chat":
                lp = None
                if f.logprobs is not None or lps[i]:
                    lp = {"content": [c for o in lps[i] for c in self._chat_logprobs(o)["content"]]}
                choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                "logprobs": lp, "finish_reason": _finish(f), "stop_reason": f.stop_reason})
            else:
                lp = None
                if lps[i]:
                    parts = [self._text_logprobs(o, 0) for o in lps[i]]
                    lp = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs")}
                choices.append({"index": i, "text": texts[i], "logprobs": lp, "finish_reason": _finish(f),
                                "stop_reason": f.stop_reason})
        counts = {i: (f.num_prompt_tokens, f.num_output_tokens, f.num_cached_tokens) for i, f in final.items()}
        return {"id": cid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": self._sum_usage(counts, n)}

    def _tok(self, i: int) -> str:
        return self.engine.tokenizer.decode([i], skip_special_tokens=False)

    def _chat_logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        if not out.logprobs:
            return None
        content = []
        for t in out.logprobs:
            s = self._tok(t.token_id)
            content.append({"token": s, "logprob": t.logprob, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self._tok(i), "logprob": lp, "bytes": list(self._tok(i).encode())}
                                             for i, lp in t.top]})
        return {"content": content}

    def _text_logprobs(self, out: RequestOutput, offset: int) -> dict[str, Any] | None:
        if not out.logprobs:
            return None
        return {"tokens": [self._tok(t.token_id) for t in out.logprobs],
                "token_logprobs": [t.logprob for t in out.logprobs],
                "top_logprobs": [{self._tok(i): lp for i, lp in t.top} for t in out.logprobs],
                "text_offset": [offset] * len(out.logprobs)}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "fleetllm",
             "max_model_len": self.engine.max_model_len}]})

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        if "messages" in body:
            text = self.engine.tokenizer.apply_chat_template(chat_messages(body), body.get("add_generation_prompt", True))
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            ids = self.engine.tokenizer.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
        else:
            raise APIError(400, "give prompt (a string) or messages", "prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body = await self._body(request)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise APIError(400, "tokens must be a list of integers", "tokens")
        vocab = self.engine.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in toks):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": self.engine.tokenizer.decode(toks, skip_special_tokens=False)})

    async def health(self, request: Request) -> Response:
        t = self.async_engine._thread
        if t is None or not t.is_alive():
            return JSONResponse({"status": "engine loop is not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def load(self) -> dict[str, Any]:
        """The worker's load as routers see it (read without locking: a slightly stale view is fine)."""
        sched = self.engine.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_usage": self.engine.pool.usage}

    async def kv_events(self, request: Request) -> Response:
        """KV events as a server-sent event stream, for KV-aware routers.

        First a ``snapshot`` (instance id, model, block size, pool size and every cached block hash),
        then ``stored`` / ``removed`` events with the hashes of blocks entering or leaving the prefix
        cache, and a ``load`` event (running, waiting, KV usage) at least every ``interval`` seconds.
        Hashes are :func:`fleetllm.engine.block_pool.hash_block` chains keyed by the served model name.
        """
        interval = float(request.query_params.get("interval", "0.5"))
        q, snapshot = await self.async_engine.subscribe_kv_events()

        def event(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def stream() -> AsyncIterator[str]:
            try:
                yield event({"type": "snapshot", "instance": self.instance_id, "model": self.model_name,
                             "block_size": self.engine.pool.block_size, "num_blocks": self.engine.pool.num_blocks,
                             "role": self.role,
                             "hashes": snapshot, **self.load()})
                next_load = time.monotonic() + interval
                while not self.closing:
                    timeout = max(0.0, next_load - time.monotonic())
                    try:
                        kind, hashes = await asyncio.wait_for(q.get(), timeout)
                        yield event({"type": kind, "hashes": hashes})
                    except TimeoutError:
                        pass
                    if time.monotonic() >= next_load:
                        yield event({"type": "load", **self.load()})
                        next_load = time.monotonic() + interval
            finally:
                self.async_engine.unsubscribe_kv_events(q)

        return StreamingResponse(stream(), media_type="text/event-stream")


def _finish(out: RequestOutput) -> str | None:
    return {"abort": "abort", "error": "error"}.get(out.finish_reason or "", out.finish_reason)


def _as_api_error(e: BaseException) -> BaseException:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(503, f"server overloaded: {e}; retry later")
    if isinstance(e, InvalidParameter):
        return APIError(400, str(e), e.param)
    return e
