"""The Anthropic Messages API (``POST /v1/messages``) on the chat path: translate in, run, translate out.

A Messages request becomes a chat request (system prompt, ``tool_use`` blocks as assistant
``tool_calls``, ``tool_result`` blocks as ``tool`` messages, ``tool_choice`` auto / any / tool / none),
runs exactly as ``/v1/chat/completions`` would (same template, tool grammar and parser), and its chat
response or chunks become a Message or the Messages stream events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). The functions
here are pure; :func:`messages_route` is the handler over a worker's public methods.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetllm.server import anthropic_errors
from fleetllm.server import openai_format as fmt
from fleetllm.server.protocol import APIError, sampling_from_body
from fleetllm.tools.request import tool_request
from fleetllm.tools.stream import ToolStream, rewrite_message

if TYPE_CHECKING:
    from fleetllm.server.app import Worker

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---- request ----------------------------------------------------------------------------------------
def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body of a Messages request (APIError 400 naming a bad field)."""
    if not isinstance(body.get("max_tokens"), int):
        raise APIError(400, "max_tokens is required (an integer)", "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"messages[{i}].role must be user or assistant", "messages")
        out += _chat_messages(m)
    chat = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream") if k in body}
    chat["messages"] = out
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    chat.update(_tool_choice(body.get("tool_choice")))
    return chat


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    raise APIError(400, f"{field} must be a string or a list of blocks", field)


def _chat_messages(m: dict[str, Any]) -> list[dict[str, Any]]:
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise APIError(400, "message content must be a string or a list of blocks", "messages")
    texts = [b.get("text", "") for b in content if b.get("type") == "text"]
    if m["role"] == "assistant":
        calls = [{"id": b["id"], "type": "function",
                  "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}}
                 for b in content if b.get("type") == "tool_use"]
        return [{"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})}]
    results = [{"role": "tool", "tool_call_id": b.get("tool_use_id"),
                "content": _text(b.get("content", ""), "messages") if not isinstance(b.get("content"), str)
                else b["content"]} for b in content if b.get("type") == "tool_result"]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise APIError(400, f"tools[{i}] must have a name", "tools")
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                             "parameters": t.get("input_schema") or {"type": "object"}}}


def _tool_choice(tc: Any) -> dict[str, Any]:
    if tc is None:
        return {}
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise APIError(400, "tool_choice.type must be auto, any, tool or none", "tool_choice")
    out: dict[str, Any] = {"parallel_tool_calls": not tc.get("disable_parallel_tool_use", False)}
    kind = tc["type"]
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return out


# ---- response ---------------------------------------------------------------------------------------
def message_response(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A Message from a (tool-rewritten) chat response of one choice."""
    choice = chat["choices"][0]
    msg = choice["message"]
    blocks: list[dict[str, Any]] = []
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"])})
    reason, seq = _stop(choice)
    return {"id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": model, "content": blocks, "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(chat["usage"])}


def _stop(choice: dict[str, Any]) -> tuple[str, str | None]:
    seq = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(seq, str):
        return "stop_sequence", seq
    return STOP_REASONS.get(choice.get("finish_reason") or "", "end_turn"), None


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def event(kind: str, data: dict[str, Any]) -> str:
    """One Messages stream event."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageStream:
    """Chat chunk choices (tool-rewritten) -> Messages stream events, one content block at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" | "tool_use"

    def events(self, choice: dict[str, Any]) -> list[str]:
        delta, out = choice["delta"], []
        if delta.get("content"):
            out += self._start("text", {"type": "text", "text": ""})
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "text_delta", "text": delta["content"]}}))
        for tc in delta.get("tool_calls") or []:
            if tc.get("id"):
                self._close(out)
                out += self._start("tool_use", {"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                                                "input": {}})
            elif tc["function"].get("arguments"):
                out.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": tc["function"]["arguments"]}}))
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        if self.open == kind:
            return []
        out: list[str] = []
        self._close(out)
        self.index += 1
        self.open = kind
        return [*out, event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self, out: list[str]) -> None:
        if self.open is not None:
            out.append(event("content_block_stop", {"index": self.index}))
            self.open = None

    def finish(self, choice: dict[str, Any], usage: dict[str, int]) -> list[str]:
        out: list[str] = []
        self._close(out)
        reason, seq = _stop(choice)
        out.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                           "usage": usage}))
        return [*out, event("message_stop", {})]


# ---- the endpoint -----------------------------------------------------------------------------------
def messages_route(worker: Worker) -> Route:
    """``POST /v1/messages`` on ``worker``."""

    async def messages(request: Request) -> Response:
        try:
            return await answer(request)
        except APIError as e:  # refused before the answer started: in Anthropic's error shape
            return anthropic_errors.error_response(e)

    async def answer(request: Request) -> Response:
        body = chat_body(await worker.request_body(request))
        ids = await worker.encoded("chat", body)
        tools = tool_request(body, worker.tool_parser)
        params = await worker.constrained(sampling_from_body(body, chat=True), body, tools.grammar)
        if params.n != 1:
            raise APIError(400, "n is not part of the Messages API", "n")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        gen = worker.run_request(request, rid, "chat", ids, params)
        if not body.get("stream"):
            outs = await worker.collect(request, gen)
            chat = fmt.completion_response("chat", "chatcmpl-" + rid, worker.model_name, int(time.time()), outs, 1, 1,
                                           worker.token_text)
            chat["choices"] = [rewrite_message(c, tools.parser) for c in chat["choices"]]
            return JSONResponse(message_response(chat, worker.model_name), headers={"x-request-id": rid})
        first = await worker.until_disconnect(request, gen.__anext__())
        return StreamingResponse(_stream(worker, rid, first, gen, ToolStream(tools.parser), len(ids[0])),
                                 media_type="text/event-stream", headers={"x-request-id": rid})

    return Route("/v1/messages", messages, methods=["POST"])


async def _stream(worker: Worker, rid: str, first: Any, gen: AsyncIterator[Any], tools: ToolStream,
                  prompt_tokens: int) -> AsyncIterator[str]:
    ms = MessageStream()
    yield event("message_start", {"message": {
        "id": "msg_" + rid, "type": "message", "role": "assistant", "model": worker.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    try:
        pending = [first]
        while True:
            for _, out in pending:
                if out.error:
                    yield event("error", {"error": {"type": "api_error", "message": out.error}})
                    return
                for raw in fmt.stream_choices("chat", 0, out, False, worker.token_text):
                    for choice in tools.rewrite(raw):
                        if choice.get("finish_reason"):
                            usage = {"input_tokens": out.num_prompt_tokens - out.num_cached_tokens,
                                     "cache_read_input_tokens": out.num_cached_tokens,
                                     "output_tokens": out.num_output_tokens}
                            for e in ms.finish(choice, usage):
                                yield e
                        else:
                            for e in ms.events(choice):
                                yield e
            try:
                pending = [await gen.__anext__()]
            except StopAsyncIteration:
                return
    finally:
        await gen.aclose()
