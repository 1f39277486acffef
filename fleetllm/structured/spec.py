"""What a request asks its output to match, as plain data (the API layer builds it, the engine compiles it).

``kind`` is one of ``json`` (``source`` is a JSON schema, serialized), ``regex``, ``choice`` (``source`` is
a JSON list of strings), ``grammar`` (Lark, or GBNF when it uses ``::=``) or ``lark`` (internal grammars,
e.g. the tool-call grammar, whose ``%json`` blocks embed schemas). Frozen and hashable: the compile cache
keys on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "lark")

# Separators as json.dumps writes them: what small models most often produce, and no room for endless
# whitespace between tokens (a flexible-whitespace grammar lets a weak model pad until max_tokens).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output: ``kind`` (see :data:`KINDS`) and its ``source`` text."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        return cls("json", json.dumps(schema))  # key order kept: properties are generated in it

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options)))


def json_block(schema: dict[str, Any] | bool) -> str:
    """A Lark ``%json`` block matching ``schema`` in the compact style of :data:`JSON_STYLE`."""
    body: dict[str, Any] = {} if schema is True else dict(schema) if isinstance(schema, dict) else {"not": {}}
    body["x-guidance"] = JSON_STYLE
    return "%json " + json.dumps(body)
