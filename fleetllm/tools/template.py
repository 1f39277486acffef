"""A ChatML chat template with tools, in the Hermes style, for models whose own template has none.

SmolLM2's template renders neither tools nor assistant tool calls (and fails on ``content: null``). This
one renders the tool schemas into the system turn, an assistant's calls as ``<tool_call>`` blocks and a
``tool`` message as a ``<tool_response>`` in a user turn. Tool schemas and call arguments arrive
pre-serialized (``tool_schemas``, ``arguments`` strings): Jinja's ``tojson`` escapes ``<`` and ``>``.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

HERMES_CHATML = """\
{%- if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}
{%- if tool_schemas %}<|im_start|>system
{% if system %}{{ system }}

{% endif %}You may call functions. The functions you can call, as JSON schemas:
<tools>
{% for t in tool_schemas %}{{ t }}
{% endfor %}</tools>
To call a function, answer with one JSON object per call inside tags, like this:
<tool_call>
{"name": "function name", "arguments": {"argument": "value"}}
</tool_call><|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for m in rest %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls or [] %}{% if m.content or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_hermes = _env.from_string(HERMES_CHATML)


def render_hermes(messages: list[dict[str, Any]], tools: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The prompt text of ``messages`` with ``tools`` (OpenAI tool objects) in the Hermes ChatML format."""
    schemas = [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    return _hermes.render(messages=messages, tool_schemas=schemas, add_generation_prompt=add_generation_prompt)


def template_has_tools(template: str | None) -> bool:
    """Whether a model's own chat template renders tools (it reads a ``tools`` variable)."""
    return bool(template) and "tools" in template
