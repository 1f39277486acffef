"""The tool fields of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and the prompt.

``tool_choice``: ``none`` (tools stay in the prompt, so an agent's turns share their KV prefix, but
nothing is parsed), ``auto`` (offered; calls in the
text are parsed out), ``required`` or ``{"type": "function", "function": {"name": ...}}`` (offered and
enforced: the output is constrained to calls by the parser's grammar). Errors are APIError 400 naming
the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetllm.server.protocol import APIError
from fleetllm.structured.spec import GrammarSpec
from fleetllm.tools.parsers import ToolParser
from fleetllm.tools.template import render_hermes, template_has_tools

if TYPE_CHECKING:
    from fleetllm.models.tokenizer import TokenizerWrapper


@dataclass
class ToolRequest:
    """A request's tools and how they are used (None ``grammar``: calls are not forced)."""

    tools: list[dict[str, Any]]
    choice: str  # none | auto | required | named
    parallel: bool
    parser: ToolParser
    grammar: GrammarSpec | None

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def tool_request(body: dict[str, Any], parser: ToolParser) -> ToolRequest:
    """Validate the tool fields of ``body`` (a request without tools gets an inactive ToolRequest)."""
    tools = _tools(body.get("tools"))
    choice_field = body.get("tool_choice")
    if choice_field is None:
        choice_field = "auto" if tools else "none"
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if isinstance(choice_field, str):
        if choice_field not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be none, auto, required or a function, got {choice_field!r}",
                           "tool_choice")
        choice, forced = choice_field, tools
    else:
        name = (choice_field.get("function") or {}).get("name") if isinstance(choice_field, dict) else None
        if not isinstance(name, str):
            raise APIError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        choice, parallel = "named", False
    if choice in ("required", "named") and not tools:
        raise APIError(400, f"tool_choice {choice_field!r} needs tools", "tool_choice")
    grammar = GrammarSpec("lark", parser.grammar(forced, parallel)) if choice in ("required", "named") else None
    return ToolRequest(tools, choice, parallel, parser, grammar)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise APIError(400, "tools must be a list", "tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return raw


def needs_tool_template(messages: list[dict[str, Any]], tools: ToolRequest) -> bool:
    """Whether the prompt involves tools: offered tools, or calls and results in the history."""
    return bool(tools.tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def render_prompt(tokenizer: TokenizerWrapper, messages: list[dict[str, Any]], tools: ToolRequest,
                  add_generation_prompt: bool, **kwargs: Any) -> str:
    """The prompt text: the model's template (given the tools when it renders them), or the shipped
    Hermes template when tools are involved and the model's template cannot show them."""
    offered = tools.tools
    if not needs_tool_template(messages, tools):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    if template_has_tools(tokenizer.chat_template) or not tools.parser.uses_shipped_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=offered or None, **kwargs)
    return render_hermes(messages, offered, add_generation_prompt)
