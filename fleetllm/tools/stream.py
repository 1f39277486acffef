"""Streamed chat choices rewritten so that tool calls arrive as ``delta.tool_calls``, not as text.

Per choice: text before a call's start tag streams as content; a tag split across deltas is held back
until it is known; a call's text is buffered until it is complete (its end tag, or the end of the
output) and then sent as two deltas, as the OpenAI API and vLLM do: the call's id, type and name with
empty arguments, then its arguments. A choice that made calls finishes with ``tool_calls``.
"""

from __future__ import annotations

from typing import Any

from fleetllm.tools.parsers import ToolCall, ToolParser


class ChoiceToolStream:
    """The rewrite of one choice's deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.in_call = False
        self.calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """Content safe to send now and the calls completed by ``text``."""
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                i = self.buffer.find(self.parser.start_tag)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, self.parser.start_tag)
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return content, calls
                content += self.buffer[:i]
                self.buffer, self.in_call = self.buffer[i:], True
            end = self.parser.end_tag
            j = self.buffer.find(end) if end else -1
            if j < 0 and not final:
                return content, calls
            body = self.buffer if j < 0 else self.buffer[: j + len(end)]
            got_content, got = self.parser.extract(body)
            calls += got
            if not got and got_content:
                content += got_content
            self.buffer, self.in_call = ("" if j < 0 else self.buffer[j + len(end) :]).lstrip("\n"), False
            if j < 0:
                return content, calls


class ToolStream:
    """Rewrites the chat chunk choices of a whole request (one :class:`ChoiceToolStream` per choice)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.choices: dict[int, ChoiceToolStream] = {}

    def rewrite(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """The choices to send in place of ``choice`` (a chunk choice from openai_format.stream_choices)."""
        index = choice["index"]
        st = self.choices.setdefault(index, ChoiceToolStream(self.parser))
        delta, finishing = choice["delta"], choice.get("finish_reason") is not None
        if "role" in delta or ("content" not in delta and not finishing):
            return [choice]
        content, calls = st.feed(delta.get("content", ""), finishing)
        out = []
        if content or (choice.get("logprobs") and not finishing):
            out.append({**choice, "delta": {"content": content}, "finish_reason": None} if finishing
                       else {**choice, "delta": {"content": content}})
        for call in calls:
            out += _call_deltas(index, st.calls, call)
            st.calls += 1
        if finishing:
            reason = "tool_calls" if st.calls and choice["finish_reason"] == "stop" else choice["finish_reason"]
            out.append({**choice, "delta": {}, "finish_reason": reason})
        return out


def _call_deltas(index: int, k: int, call: ToolCall) -> list[dict[str, Any]]:
    head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    args = {"index": k, "function": {"arguments": call.arguments}}
    return [{"index": index, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}
            for d in (head, args)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def rewrite_message(choice: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    """A non-streamed chat choice with its calls moved from the content into ``message.tool_calls``."""
    content, calls = parser.extract(choice["message"]["content"] or "")
    if not calls:
        return choice
    message = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
    reason = "tool_calls" if choice["finish_reason"] == "stop" else choice["finish_reason"]
    return {**choice, "message": message, "finish_reason": reason}
