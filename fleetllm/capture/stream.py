"""A streamed answer, assembled from its SSE events into the object a non-streamed request returns.

The endpoint tier captures ``chat.completion`` / ``text_completion`` objects with ``usage``, never raw
SSE, so a capture replays the same whichever way the client asked. Chunks are fed as they are relayed
(events may span chunks); the result is built once, when the stream ends.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any


class StreamAssembler:
    """Accumulates the choices of an OpenAI SSE stream (chat or text completion)."""

    def __init__(self) -> None:
        self._rest = b""
        self._events: list[bytes] = []  # the JSON of each data event, parsed in result()
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.deltas = 0  # content deltas: one token each from a fleetllm worker
        self.done = False
        self.error: Any = None

    def feed(self, chunk: bytes) -> None:
        """One relayed chunk of the stream."""
        *events, self._rest = (self._rest + chunk).split(b"\n\n")
        for ev in events:
            if ev.startswith(b"data: {"):
                self._events.append(ev[6:])
            elif ev.startswith(b"data: [DONE]"):
                self.done = True

    def parse(self) -> None:
        """Parse the events fed so far (``usage`` is known after this)."""
        events, self._events = self._events, []
        try:
            parsed = json.loads(b"[" + b",".join(events) + b"]")
        except ValueError:  # one bad event: parse them one by one, skipping it
            parsed = []
            for ev in events:
                with contextlib.suppress(ValueError):
                    parsed.append(json.loads(ev))
        for obj in parsed:
            with contextlib.suppress(AttributeError, TypeError, KeyError, ValueError):
                self._event(obj)

    def _event(self, obj: dict[str, Any]) -> None:
        if "error" in obj:
            self.error = obj["error"]
            return
        if not self.head:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
            self.head["object"] = "chat.completion" if obj.get("object") == "chat.completion.chunk" else "text_completion"
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for c in obj.get("choices") or []:
            self._choice(c)

    def _choice(self, c: dict[str, Any]) -> None:
        i = int(c.get("index", 0))
        chat = self.head.get("object") == "chat.completion"
        acc = self.choices.setdefault(i, {"index": i, "message": {"role": "assistant", "content": ""}} if chat
                                      else {"index": i, "text": ""})
        delta = c.get("delta") or {}
        piece = delta.get("content") if chat else c.get("text")
        if piece:
            self.deltas += 1
            if chat:
                acc["message"]["content"] += piece
            else:
                acc["text"] += piece
        if chat and delta.get("tool_calls"):
            acc["message"].setdefault("tool_calls", []).extend(delta["tool_calls"])
        if c.get("logprobs"):
            lp = acc.setdefault("logprobs", {"content": []} if chat else None)
            if chat and isinstance(c["logprobs"].get("content"), list):
                lp["content"].extend(c["logprobs"]["content"])
        if c.get("finish_reason") is not None:
            acc["finish_reason"] = c["finish_reason"]

    def result(self, prompt_tokens: int | None = None) -> dict[str, Any]:
        """The assembled object; without a usage event, usage is estimated (a delta per token) from the
        router's prompt token count."""
        self.parse()
        usage = self.usage
        if usage is None:
            p = prompt_tokens or 0
            usage = {"prompt_tokens": p, "completion_tokens": self.deltas, "total_tokens": p + self.deltas,
                     "estimated": True}
        choices = [{**c, "finish_reason": c.get("finish_reason")} for _, c in sorted(self.choices.items())]
        out: dict[str, Any] = {**self.head, "choices": choices, "usage": usage}
        if self.error is not None:
            out["error"] = self.error
        return out
