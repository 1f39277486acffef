"""The Responses API (``POST /v1/responses``) on the chat path, with a bounded store for
``previous_response_id``.

A request's ``input`` (a string, or message / ``function_call`` / ``function_call_output`` items),
``instructions``, function ``tools``, ``tool_choice``, ``text.format`` (json_schema / json_object) and
``max_output_tokens`` become a chat request; the answer becomes a Response whose ``output`` holds a
``message`` item and ``function_call`` items, or the stream of ``response.*`` events. With ``store``
(default true) a response's conversation is kept, so the next turn sends only its new items and
``previous_response_id``. The store is per worker: a fleet's router pins a follow-up turn to the worker
that answered the previous one (``fleetllm/router/sessions.py``), where its KV is too.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetllm.server import openai_format as fmt
from fleetllm.server.protocol import APIError, sampling_from_body
from fleetllm.server.stored_turns import (
    MAX_STORED_CHARS,
    OWNER_HEADER,
    BoundedStore,
    items_chars,
    normalize_items,
)
from fleetllm.tools.request import tool_request
from fleetllm.tools.stream import ToolStream, rewrite_message

if TYPE_CHECKING:
    from fleetllm.server.app import Worker


class ConversationStore:
    """Stored responses' conversations (chat messages) by response id, each found only by the key that stored
    it (:mod:`.stored_turns`): the last ``capacity``, at most :data:`MAX_STORED_CHARS` characters in all."""

    def __init__(self, capacity: int = 1024, max_chars: int = MAX_STORED_CHARS) -> None:
        self._items: BoundedStore[list[dict[str, Any]]] = BoundedStore(capacity, max_chars)

    def get(self, response_id: str, owner: str = "") -> list[dict[str, Any]]:
        found = self._items.get(response_id, owner)
        if found is None:
            raise APIError(404, f"previous response {str(response_id)[:80]!r} not found (expired or on another "
                           "worker)", "previous_response_id")
        return found

    def put(self, response_id: str, messages: list[dict[str, Any]], owner: str = "") -> None:
        self._items.put(response_id, messages, owner, items_chars(messages))


# ---- request ----------------------------------------------------------------------------------------
def chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body of a Responses request following ``history`` (APIError 400 on bad fields)."""
    messages = list(history)
    if body.get("instructions") and not history:
        messages.append({"role": "system", "content": str(body["instructions"])})
    messages += input_messages(body.get("input"))
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls")
                            if k in body}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        tc = {"type": "function", "function": {"name": tc.get("name")}}
    if tc is not None:
        chat["tool_choice"] = tc
    fmt_ = (body.get("text") or {}).get("format")
    if isinstance(fmt_, dict) and fmt_.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt_.get("name", "output"),
                                                                          "schema": fmt_.get("schema", {})}}
    elif isinstance(fmt_, dict) and fmt_.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages from a Responses ``input`` (checked and normalised first: :func:`normalize_items`)."""
    out: list[dict[str, Any]] = []
    for it in normalize_items(items):
        if it["type"] == "message":
            out.append({"role": {"developer": "system"}.get(it["role"], it["role"]), "content": it["content"]})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


def _tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise APIError(400, f"tools[{i}]: only function tools (type function, with a name) are supported", "tools")
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                             "parameters": t.get("parameters") or {"type": "object"}}}


# ---- response ---------------------------------------------------------------------------------------
def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``output`` items of a (tool-rewritten) chat message."""
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(text_item("msg_" + uuid.uuid4().hex[:24], message["content"]))
    for c in message.get("tool_calls") or []:
        items.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    return items


def text_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed" else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(rid: str, model: str, body: dict[str, Any], output: list[dict[str, Any]],
                    finish_reason: str | None, usage: dict[str, Any] | None, status: str = "completed") -> dict[str, Any]:
    """A Response object (``status`` ``in_progress`` while streaming; ``incomplete`` on max_output_tokens)."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "store": body.get("store", True), "usage": usage}


def response_usage(u: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"], "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def conversation(chat: dict[str, Any], message: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a stored response leaves for the next turn."""
    return [*chat["messages"], {"role": "assistant", "content": message.get("content"),
                                **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})}]


class ResponseStream:
    """Chat chunk choices (tool-rewritten) -> ``response.*`` events; builds the final output as it goes."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text: str | None = None  # the open message item's text (None: none open)
        self.call: dict[str, Any] | None = None  # the function call whose arguments are arriving

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return fmt.sse_event({"type": kind, "sequence_number": self.seq, **data}, ensure_ascii=False)

    def events(self, choice: dict[str, Any]) -> list[str]:
        delta, out = choice["delta"], []
        if delta.get("content"):
            if self.text is None:
                out += self._open_text()
            self.text += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=self.output[-1]["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=delta["content"]))
        for tc in delta.get("tool_calls") or []:
            if tc.get("id"):
                out += self._close()
                self.call = call_item(tc["id"], tc["function"]["name"], "", "in_progress")
                self.output.append(self.call)
                out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=dict(self.call)))
            elif self.call is not None:
                self.call["arguments"] += tc["function"]["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                                      output_index=len(self.output) - 1, delta=tc["function"]["arguments"]))
        return out

    def _open_text(self) -> list[str]:
        out = self._close()
        self.text = ""
        self.output.append(text_item("msg_" + uuid.uuid4().hex[:24], "", "in_progress"))
        i, item_id = len(self.output) - 1, self.output[-1]["id"]
        part = {"type": "output_text", "text": "", "annotations": []}
        return [*out, self.event("response.output_item.added", output_index=i, item=dict(self.output[-1])),
                self.event("response.content_part.added", item_id=item_id, output_index=i, content_index=0, part=part)]

    def _close(self) -> list[str]:
        i = len(self.output) - 1
        if self.text is not None:
            item = self.output[i] = text_item(self.output[i]["id"], self.text)
            part = item["content"][0]
            self.text = None
            return [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=part),
                    self.event("response.output_item.done", output_index=i, item=item)]
        if self.call is not None:
            self.call["status"] = "completed"
            call, self.call = self.call, None
            return [self.event("response.function_call_arguments.done", item_id=call["id"], output_index=i,
                               arguments=call["arguments"]),
                    self.event("response.output_item.done", output_index=i, item=call)]
        return []

    def finish(self) -> list[str]:
        return self._close()


# ---- the endpoint -----------------------------------------------------------------------------------
def responses_route(worker: Worker, store: ConversationStore) -> Route:
    """``POST /v1/responses`` on ``worker``, keeping conversations in ``store``."""

    async def responses(request: Request) -> Response:
        body = await worker.request_body(request)
        prev, owner = body.get("previous_response_id"), request.headers.get(OWNER_HEADER, "")
        chat = chat_body(body, store.get(prev, owner) if prev else [])
        ids = await worker.encoded("chat", chat)
        tools = tool_request(chat, worker.tool_parser)
        params = await worker.constrained(sampling_from_body(chat, chat=True), chat, tools.grammar)
        rid = uuid.uuid4().hex
        gen = worker.run_request(request, rid, "chat", ids, params)
        if not body.get("stream"):
            outs = await worker.collect(request, gen)
            resp = fmt.completion_response("chat", rid, worker.model_name, int(time.time()), outs, 1, 1,
                                           worker.token_text)
            choice = rewrite_message(resp["choices"][0], tools.parser)
            obj = response_object("resp_" + rid, worker.model_name, body, output_items(choice["message"]),
                                  choice["finish_reason"], response_usage(resp["usage"]))
            if body.get("store", True):
                store.put(obj["id"], conversation(chat, choice["message"]), owner)
            return JSONResponse(obj, headers={"x-request-id": rid})
        first = await worker.until_disconnect(request, gen.__anext__())
        kept = (lambda rid_, messages: store.put(rid_, messages, owner)) if body.get("store", True) else None
        return StreamingResponse(_stream(worker, kept, body, chat, rid, first, gen, ToolStream(tools.parser)),
                                 media_type="text/event-stream", headers={"x-request-id": rid})

    return Route("/v1/responses", responses, methods=["POST"])


async def _stream(worker: Worker, keep: Callable[[str, list[dict[str, Any]]], None] | None, body: dict[str, Any],
                  chat: dict[str, Any], rid: str, first: Any, gen: AsyncIterator[Any], tools: ToolStream
                  ) -> AsyncIterator[str]:
    """The ``response.*`` events of a streamed turn; ``keep(response id, conversation)`` stores it at the end."""
    rs = ResponseStream()
    resp_id = "resp_" + rid
    start = response_object(resp_id, worker.model_name, body, [], None, None, "in_progress")
    yield rs.event("response.created", response=start)
    yield rs.event("response.in_progress", response=start)
    try:
        item: Any = first
        while True:
            _, out = item
            if out.error:
                yield rs.event("error", code="server_error", message=out.error, param=None)
                return
            for raw in fmt.stream_choices("chat", 0, out, False, worker.token_text):
                for choice in tools.rewrite(raw):
                    for e in rs.events(choice):
                        yield e
                    if choice.get("finish_reason"):
                        for e in rs.finish():
                            yield e
                        usage = response_usage(fmt.total_usage({0: fmt.token_counts(out)}, 1))
                        final = response_object(resp_id, worker.model_name, body, rs.output, out.finish_reason, usage)
                        if keep is not None:
                            keep(resp_id, conversation(chat, _message(rs.output)))
                        yield rs.event("response.completed" if final["status"] == "completed"
                                       else "response.incomplete", response=final)
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                return
    finally:
        await gen.aclose()


def _message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message of a response's output items (for the stored conversation)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return {"content": text or None, "tool_calls": calls}
