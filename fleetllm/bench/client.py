"""One streaming request to an OpenAI-compatible endpoint, timed chunk by chunk.

Every timestamp is ``time.perf_counter_ns()`` (monotonic, ns), taken when a chunk carrying text is
parsed, so TTFT includes the server's queueing, prefill and the network. A failure never raises out of
``send_request``: it is recorded as an error *kind* so that a bad server cannot crash a run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

CHAT = "chat"
COMPLETIONS = "completions"
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


@dataclass
class RequestSpec:
    """What to send: either chat ``messages`` or a plain ``prompt``, plus the output budget."""

    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    session_id: str = ""
    turn: int = 0
    expected_input_tokens: int | None = None
    cancel_after_chunks: int | None = None  # close the stream after this many chunks (an abort)
    body: dict[str, Any] | None = None  # request fields of this request only (over the client's)


@dataclass
class RequestRecord:
    """What happened to one request; all times are monotonic ns."""

    request_id: int
    session_id: str
    turn: int
    max_tokens: int
    expected_input_tokens: int | None
    scheduled_ns: int
    start_ns: int
    end_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: the server's prefix hit
    worker: str | None = None  # the worker a fleetllm router sent it to (its x-fleetllm-worker header)
    output_tokens_from_usage: bool = False
    output_text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    error_detail: str | None = None
    cancelled: bool = False
    warmup: bool = False

    @property
    def ok(self) -> bool:
        """A request that finished normally (not failed, not cancelled on purpose)."""
        return self.error is None and not self.cancelled

    @property
    def first_token_ns(self) -> int | None:
        return self.chunk_ns[0] if self.chunk_ns else None


@dataclass
class ClientConfig:
    """How to talk to the server."""

    base_url: str
    model: str
    endpoint: str = CHAT
    api_key: str | None = None
    request_timeout_s: float = 600.0
    ignore_eos: bool = True  # vLLM-style extension so the output length is the asked OSL
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_body(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body for one streaming request, with usage requested in the last chunk."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == CHAT:
        body["messages"] = spec.messages if spec.messages is not None else [
            {"role": "user", "content": spec.prompt or ""}
        ]
    else:
        body["prompt"] = spec.prompt if spec.prompt is not None else _flatten_messages(spec.messages or [])
    body.update(cfg.extra_body)
    body.update(spec.body or {})
    return body


def _flatten_messages(messages: list[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages)


def make_http_client(cfg: ClientConfig, max_connections: int) -> httpx.AsyncClient:
    """An async client sized so connection pooling never becomes the bottleneck of the load."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max_connections + 8, max_keepalive_connections=max_connections + 8)
    return httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"),
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=min(30.0, cfg.request_timeout_s)),
    )


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == CHAT:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    spec: RequestSpec,
    request_id: int,
    scheduled_ns: int | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> RequestRecord:
    """Send ``spec`` as a streaming request and record its timings; never raises on server faults."""
    start = time.perf_counter_ns()
    rec = RequestRecord(
        request_id=request_id,
        session_id=spec.session_id,
        turn=spec.turn,
        max_tokens=spec.max_tokens,
        expected_input_tokens=spec.expected_input_tokens,
        scheduled_ns=scheduled_ns if scheduled_ns is not None else start,
        start_ns=start,
    )
    pieces: list[str] = []
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            await _stream(http, cfg, spec, rec, pieces, on_first_token)
    except TimeoutError:
        rec.error, rec.error_detail = "timeout", f"no completion within {cfg.request_timeout_s}s"
    except httpx.TimeoutException as e:
        rec.error, rec.error_detail = "timeout", repr(e)
    except httpx.ConnectError as e:
        rec.error, rec.error_detail = "connection", repr(e)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        rec.error, rec.error_detail = "stream_broken", repr(e)
    except httpx.HTTPError as e:
        rec.error, rec.error_detail = "http_other", repr(e)
    rec.end_ns = time.perf_counter_ns()
    rec.output_text = "".join(pieces)
    if rec.error is None and not rec.cancelled and not rec.chunk_ns:
        rec.error, rec.error_detail = "empty_response", "stream ended without any text"
    if rec.output_tokens is None:
        # Without usage the chunk count is the best client-side estimate (1 token per chunk).
        rec.output_tokens = len(rec.chunk_ns)
    return rec


async def _stream(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    spec: RequestSpec,
    rec: RequestRecord,
    pieces: list[str],
    on_first_token: Callable[[], None] | None,
) -> None:
    body = build_body(cfg, spec)
    # the session id lets session-affine routers keep a conversation on one replica
    headers = {"x-session-id": spec.session_id} if spec.session_id else None
    async with http.stream("POST", ENDPOINT_PATHS[cfg.endpoint], json=body, headers=headers) as resp:
        rec.worker = resp.headers.get("x-fleetllm-worker")
        if resp.status_code != 200:
            detail = (await resp.aread())[:300].decode(errors="replace")
            rec.error, rec.error_detail = f"http_{resp.status_code}", detail
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            now = time.perf_counter_ns()
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                rec.error, rec.error_detail = "bad_chunk", data[:300]
                return
            if "error" in chunk:
                rec.error, rec.error_detail = "stream_error", json.dumps(chunk["error"])[:300]
                return
            usage = chunk.get("usage")
            if usage:
                rec.input_tokens = usage.get("prompt_tokens")
                rec.output_tokens = usage.get("completion_tokens")
                rec.output_tokens_from_usage = rec.output_tokens is not None
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or []:
                text = _chunk_text(choice, cfg.endpoint)
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
                if not text:
                    continue
                if not rec.chunk_ns and on_first_token is not None:
                    on_first_token()
                rec.chunk_ns.append(now)
                pieces.append(text)
            if spec.cancel_after_chunks is not None and len(rec.chunk_ns) >= spec.cancel_after_chunks:
                # Leaving the context manager closes the connection: the server sees a client abort.
                rec.cancelled = True
                return
