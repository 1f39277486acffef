"""What is removed before anything is written: credentials always, then the operator's patterns and hook.

A JSON payload (a request body, a response) is redacted string by string, after decoding: a pattern
sees ``"sk-\\u0041BC"`` as ``sk-ABC`` and ``\\u00e9`` as ``é``, as the reader of the capture will, and a
mask never cuts through the JSON's structure. Other payloads (the worker tier's prompt and output text)
are redacted as they are. Credentials never reach a record: headers are not captured at all, and
secret-looking JSON fields and bearer tokens are masked even with no pattern configured.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from typing import Any

MASK = "[REDACTED]"
# a JSON field whose name says it holds a secret, and bearer tokens wherever they appear
_CREDENTIALS = re.compile(
    r'("(?:api[_-]?key|authorization|x-api-key|password|secret|access[_-]?token)"\s*:\s*)"(?:[^"\\]|\\.)*"'
    r"|(Bearer\s+)[A-Za-z0-9._~+/=-]+",
    re.IGNORECASE)

# the credential pattern runs only on text holding one of these (lowercased): a substring test is ~50x cheaper
_TRIGGERS = ('"api', '"authorization', '"x-api-key', '"password', '"secret', '"access', "bearer")
# a decoded JSON field whose name says it holds a secret (compared lowercased, '-' as '_')
_SECRET_FIELDS = frozenset({"api_key", "apikey", "authorization", "x_api_key", "password", "secret", "access_token"})
_BEARER = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)

Hook = Callable[[str, dict[str, Any]], "dict[str, Any] | None"]


class Redactor:
    """Masks credentials and the configured patterns in payload text; runs the hook on whole records."""

    def __init__(self, patterns: list[str] | None = None, hook: str | Hook | None = None) -> None:
        self.patterns = [re.compile(p) for p in patterns or []]
        self.hook = load_hook(hook) if isinstance(hook, str) else hook

    def text(self, s: str) -> tuple[str, bool]:
        """``s`` with credentials and pattern matches masked; and whether an operator pattern matched."""
        low = s.lower()
        if any(t in low for t in _TRIGGERS):
            s = _CREDENTIALS.sub(_mask_credential, s)
        hit = False
        for p in self.patterns:
            s, n = p.subn(MASK, s)
            hit = hit or n > 0
        return s, hit

    def json_text(self, s: str) -> tuple[str, bool]:
        """Like :meth:`text`, for JSON text: every decoded string redacted, secret-named fields masked.

        Text that is not JSON is redacted as text. Unchanged JSON is returned as it came (byte for byte)."""
        if not self.patterns and "\\u" not in s and not any(t in s.lower() for t in _TRIGGERS):
            return s, False  # only a \uXXXX escape could hide a trigger's letters from this test
        try:
            doc = json.loads(s)
        except ValueError:
            return self.text(s)
        hits = [False, False]  # [anything changed, an operator pattern matched]
        doc = self._walk(doc, hits)
        if not hits[0]:
            return s, False
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")), hits[1]

    def _walk(self, node: Any, hits: list[bool]) -> Any:
        if isinstance(node, str):
            out, n = _BEARER.subn(lambda m: m.group(1) + MASK, node)
            for p in self.patterns:
                out, k = p.subn(MASK, out)
                hits[1] = hits[1] or k > 0
                n += k
            hits[0] = hits[0] or n > 0
            return out
        if isinstance(node, list):
            return [self._walk(v, hits) for v in node]
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if isinstance(v, str) and k.lower().replace("-", "_") in _SECRET_FIELDS:
                    hits[0] = True
                    out[k] = MASK
                else:
                    out[k] = self._walk(v, hits)
            return out
        return node

    def record(self, tier: str, record: dict[str, Any]) -> dict[str, Any] | None:
        """The hook's verdict on a finished record (None: drop it)."""
        return record if self.hook is None else self.hook(tier, record)


def _mask_credential(m: re.Match[str]) -> str:
    return f'{m.group(1)}"{MASK}"' if m.group(1) else f"{m.group(2)}{MASK}"


def load_hook(ref: str) -> Hook:
    """``package.module:function`` as a callable."""
    module, _, name = ref.partition(":")
    if not name:
        raise ValueError(f"redact hook must be module:function, not {ref!r}")
    return getattr(importlib.import_module(module), name)
