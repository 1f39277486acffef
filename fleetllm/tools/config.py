"""Tool-calling settings of ``fleetllm worker``."""

from __future__ import annotations

from dataclasses import dataclass

from fleetllm.cli_options import opt


@dataclass
class ToolConfig:
    """How a worker reads tool calls out of its model's text."""

    tool_call_parser: str = opt("auto", "tool-call syntax: hermes (<tool_call>{json}</tool_call>), llama3_json, "
                                        "or auto (from the chat template; hermes when it has no tool support)")
