"""A small OpenAI-compatible streaming server for bench tests, run in a thread on 127.0.0.1.

Deterministic by construction: each request streams exactly ``max_tokens`` one-word tokens (or
``tokens_per_chunk`` per chunk) with ``token_delay_s`` between chunks. Faults are injected by magic
words in the prompt (``FAIL_500``, ``HANG``, ``BREAK``) or by ``fail_every`` (every k-th request
answers 503). It records every body it receives and counts aborted streams.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeState:
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    tokens_per_chunk: int = 1
    fail_every: int = 0
    include_usage: bool = True
    tokenize: bool = True
    bodies: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    waiting_first_token: int = 0
    max_waiting_first_token: int = 0
    seen_systems: set[str] = field(default_factory=set)
    prefix_queries: int = 0
    prefix_hits: int = 0


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(m["content"] for m in body["messages"])
    return body.get("prompt", "")


def make_app(state: FakeState) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        chat = request.url.path.endswith("chat/completions")
        text = _prompt_text(body)
        n_prompt = len(text.split())
        # Prefix-cache accounting: the system message counts as a hit when seen before.
        if chat and body["messages"] and body["messages"][0]["role"] == "system":
            sys_text = body["messages"][0]["content"]
            state.prefix_queries += n_prompt
            if sys_text in state.seen_systems:
                state.prefix_hits += len(sys_text.split())
            state.seen_systems.add(sys_text)
        if "FAIL_500" in text or (state.fail_every and len(state.bodies) % state.fail_every == 0):
            return JSONResponse({"error": {"message": "injected"}}, status_code=500 if "FAIL_500" in text else 503)
        max_tokens = int(body.get("max_tokens", 16))
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and state.include_usage

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            state.waiting_first_token += 1
            state.max_waiting_first_token = max(state.max_waiting_first_token, state.waiting_first_token)
            waiting = True
            finished = False
            try:
                if "HANG" in text:
                    await asyncio.sleep(3600)
                await asyncio.sleep(state.first_token_delay_s)
                sent = 0
                while sent < max_tokens:
                    k = min(state.tokens_per_chunk, max_tokens - sent)
                    piece = "".join(f"w{sent + j} " for j in range(k))
                    sent += k
                    if chat:
                        choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": piece, "finish_reason": None}
                    if sent == max_tokens:
                        choice["finish_reason"] = "length"
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    if waiting:
                        waiting = False
                        state.waiting_first_token -= 1
                    if "BREAK" in text and sent >= 2:
                        raise RuntimeError("injected stream break")
                    if sent < max_tokens:
                        await asyncio.sleep(state.token_delay_s)
                if usage:
                    u = {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                         "total_tokens": n_prompt + max_tokens}
                    yield f"data: {json.dumps({'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                if waiting:
                    state.waiting_first_token -= 1
                state.in_flight -= 1
                if not finished and "BREAK" not in text:
                    state.aborted += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(request: Request) -> Response:
        if not state.tokenize:
            return JSONResponse({"error": "no"}, status_code=404)
        body = await request.json()
        toks = body.get("prompt", "").split()
        return JSONResponse({"tokens": list(range(len(toks))), "count": len(toks)})

    async def metrics(request: Request) -> Response:
        lines = [
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{model_name="fake"}} {state.prefix_queries}',
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{model_name="fake"}} {state.prefix_hits}',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{model_name="fake"}} {0.25 if state.bodies else 0.0}',
            "# TYPE vllm:request_success counter",
            f'vllm:request_success_total{{model_name="fake"}} {len(state.bodies)}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/health", health),
    ])


class FakeServer:
    """Runs the fake app with uvicorn in a daemon thread; ``url`` is its base URL."""

    def __init__(self, state: FakeState | None = None):
        self.state = state or FakeState()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(make_app(self.state), log_level="error", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
