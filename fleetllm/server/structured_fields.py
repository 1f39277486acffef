"""The structured-output fields of a request body, as one :class:`GrammarSpec` (or None).

Accepted, under the OpenAI and vLLM names: ``response_format`` (``text``, ``json_object``,
``json_schema`` with ``json_schema.schema`` and ``strict``), vLLM's ``structured_outputs`` object
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one constraint per request; a malformed
field is an APIError 400 naming it. Whether the constraint compiles is checked by the engine's
compiler (:func:`check_compiles`), also a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fleetllm.engine.params import SamplingParams
from fleetllm.server.protocol import APIError
from fleetllm.structured.spec import GrammarSpec

if TYPE_CHECKING:
    from fleetllm.structured.compiler import GrammarCompiler

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def names_constraint(body: dict[str, Any]) -> bool:
    """Whether the request has any field that may set an output constraint (checked or not)."""
    return any(body.get(name) is not None for name in ("response_format", "structured_outputs", *GUIDED))


def structured_from_body(body: dict[str, Any]) -> tuple[GrammarSpec, str] | None:
    """The request's constraint and the field that set it, or None when it asks for none."""
    found: list[tuple[GrammarSpec, str]] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append((rf, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object", "structured_outputs")
        found += [(_spec(f"structured_outputs.{k}", k, v), "structured_outputs")
                  for k, v in so.items() if k in ("json", "regex", "choice", "grammar") and v is not None]
        if so.get("json_object"):
            found.append((GrammarSpec.json_schema({"type": "object"}), "structured_outputs"))
    found += [(_spec(name, kind, body[name]), name) for name, kind in GUIDED.items() if body.get(name) is not None]
    if len(found) > 1:
        names = sorted({f for _, f in found})
        raise APIError(400, f"give at most one output constraint, got {len(found)} ({', '.join(names)})", names[0])
    return found[0] if found else None


def check_compiles(compiler: GrammarCompiler, spec: GrammarSpec, field: str) -> None:
    """APIError 400 naming ``field`` and the problem when ``spec`` does not compile (cached when it does)."""
    from fleetllm.structured.compiler import InvalidGrammar

    try:
        compiler.compile(spec)
    except InvalidGrammar as e:
        raise APIError(400, f"invalid {field}: {e}", field) from None


def _response_format(rf: Any) -> GrammarSpec | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError(400, "response_format must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format.json_schema must be an object", "response_format")
        schema = js.get("schema", {})  # OpenAI allows it absent: any JSON value
        if not isinstance(schema, dict | bool):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object", "response_format")
        # strict or not, the output is constrained: a schema that is asked for is a schema that is kept
        return GrammarSpec.json_schema(schema)
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   "response_format")


def _spec(field: str, kind: str, value: Any) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise APIError(400, f"{field} is not valid JSON: {e}", field) from None
        if not isinstance(value, dict | bool):
            raise APIError(400, f"{field} must be a JSON schema object", field)
        return GrammarSpec.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise APIError(400, f"{field} must be a non-empty list of strings", field)
        return GrammarSpec.choice(value)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{field} must be a non-empty string", field)
    return GrammarSpec(kind, value)


def constrain(params: SamplingParams, body: dict[str, Any], compiler: Callable[[], GrammarCompiler],
              forced: GrammarSpec | None = None) -> SamplingParams:
    """``params`` with the request's output constraint: its structured-output field, or ``forced`` (the
    tool-call grammar of ``tool_choice`` required / named); both at once is a 400. Compiles it (cached).

    ``compiler`` is called only for a request with a constraint: its first call builds the compiler, which
    imports torch and llguidance (seconds; on a busy host tens of seconds)."""
    asked = structured_from_body(body)
    if asked is not None and forced is not None:
        raise APIError(400, f"{asked[1]} cannot be combined with a required or named tool_choice", asked[1])
    spec, field = asked if asked is not None else (forced, "tool_choice")
    if spec is None:
        return params
    check_compiles(compiler(), spec, field)
    return replace(params, structured=spec)
