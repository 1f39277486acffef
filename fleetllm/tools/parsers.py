"""Tool-call parsers, one per model family's syntax, registered by name (``--tool-call-parser``).

A parser knows its syntax three ways: ``extract`` reads calls out of a finished text, ``grammar`` is the
Lark grammar (for :mod:`fleetllm.structured`) that forces one or more valid calls when ``tool_choice``
is ``required`` or names a function, and ``start_tag`` marks where a call begins in a stream (text
before it streams as content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fleetllm.structured.spec import json_block


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (as the OpenAI API sends)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """The base: a family's call syntax (subclasses set the tags and the JSON keys)."""

    name: ClassVar[str]
    start_tag: ClassVar[str]
    end_tag: ClassVar[str | None]
    args_key: ClassVar[str]
    separator: ClassVar[str]
    uses_shipped_template: ClassVar[bool]

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content outside calls (None when empty) and the complete calls, in order."""
        raise NotImplementedError

    def parse_call(self, body: str) -> ToolCall | None:
        """One call from its JSON body, or None when it is not a call."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.args_key, obj.get("arguments", obj.get("parameters", {})))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def call_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON schema of one call to any of ``tools``."""
        options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     self.args_key: t["function"].get("parameters") or {"type": "object"}},
                    "required": ["name", self.args_key], "additionalProperties": False} for t in tools]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar of one call (or several when ``parallel``) to ``tools``."""
        end = json.dumps(self.end_tag) if self.end_tag else ""
        call = f"call: {json.dumps(self.start_tag)} {json_block(self.call_schema(tools))} {end}"
        start = f"start: call ({json.dumps(self.separator)} call)*" if parallel else "start: call"
        return start + "\n" + call


class HermesParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen; fleetllm's ChatML template)."""

    name = "hermes"
    start_tag = "<tool_call>\n"
    end_tag = "\n</tool_call>"
    args_key = "arguments"
    separator = "\n"
    uses_shipped_template = True
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, kept, pos = [], [], 0
        for m in self._call.finditer(text):
            call = self.parse_call(m.group(1))
            if call is None:
                continue  # not a call after all (or cut off): it stays in the content
            kept.append(text[pos : m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept).strip()
        return (content or None) if calls else (text or None), calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
    several separated by ``; ``."""

    name = "llama3_json"
    start_tag = "{"
    end_tag = None
    args_key = "parameters"
    separator = "; "
    uses_shipped_template = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text or None, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                break
            call = self.parse_call(json.dumps(obj))
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in "; \n":
                pos += 1
        return (None if calls else text or None), calls

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        call = f"call: {json_block(self.call_schema(tools))}"
        start = f"start: call ({json.dumps(self.separator)} call)*" if parallel else "start: call"
        return start + "\n" + call


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """The parser called ``name``; ``auto`` reads the chat template (Llama 3's ipython role, else Hermes)."""
    if name == "auto":
        name = "llama3_json" if chat_template and "<|python_tag|>" in chat_template else "hermes"
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: auto, {', '.join(PARSERS)})")
    return PARSERS[name]()
