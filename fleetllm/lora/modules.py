"""``--lora-modules``: the adapters a worker serves from its start, as vLLM's flag writes them.

Each value is ``NAME=PATH`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``; a path
is a local directory, ``hf://org/name[@revision]`` or ``s3://bucket/prefix`` (fetched through the model store).
The JSON form may also name the adapter's own store token (``token_env`` or ``token_file``): a hub token is
never shared between sources, so an adapter gets none unless its entry names one. Stdlib only: the CLI, the
router and the fleet config read it without torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fleetllm.errors import UsageError
from fleetllm.store.uri import ModelURI, is_remote

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")  # what a request's `model` may carry
_JSON_KEYS = {"name", "path", "base_model_name", "token_env", "token_file"}


@dataclass(frozen=True)
class LoraModule:
    """One adapter to serve: its routing name, where its files are, and the base model it was trained on."""

    name: str
    path: str
    base_model_name: str | None = None  # vLLM's: the `parent` /v1/models shows (default: the served model)
    token_env: str | None = None  # the adapter's own hub token (hf:// sources), never the model's
    token_file: str | None = None

    def as_json(self) -> str:
        """This module as one ``--lora-modules`` value (the JSON form, which carries every field)."""
        d = {k: v for k, v in vars(self).items() if v is not None}
        return json.dumps(d, separators=(",", ":"))


def parse_module(text: str) -> LoraModule:
    """One ``--lora-modules`` value; a UsageError naming the value and the two forms otherwise."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except ValueError:
            d = None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise UsageError(f"--lora-modules {text!r}: the JSON form is "
                             '{"name": NAME, "path": PATH, "base_model_name": MODEL}')
        unknown = set(d) - _JSON_KEYS
        if unknown:
            raise UsageError(f"--lora-modules {text!r}: unknown key {sorted(unknown)[0]!r} "
                             f"(valid: {', '.join(sorted(_JSON_KEYS))})")
        module = LoraModule(**{k: (str(v) if v is not None else None) for k, v in d.items()})
    else:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--lora-modules {text!r}: give NAME=PATH (or the JSON form "
                             '{"name": NAME, "path": PATH, "base_model_name": MODEL})')
        module = LoraModule(name.strip(), path.strip())
    check_name(module.name, f"--lora-modules {text!r}")
    if is_remote(module.path) or "://" in module.path:
        ModelURI.parse(module.path)  # a malformed store URI is refused before anything starts
    return module


def check_name(name: str, where: str) -> None:
    """An adapter's name: what clients send as ``model`` (letters, digits, ``._:/-``; 128 at most)."""
    if not NAME.fullmatch(name):
        raise UsageError(f"{where}: adapter name {name!r} must be 1-128 letters, digits or ._:/- "
                         "(it is what clients send as `model`)")


def parse_modules(values: list[str] | None, served: str | None = None) -> list[LoraModule]:
    """Every ``--lora-modules`` value (each flag may carry several), names distinct and none the base model's."""
    modules = [parse_module(v) for v in values or []]
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise UsageError(f"--lora-modules: adapter name {m.name!r} is given twice")
        if served is not None and m.name == served:
            raise UsageError(f"--lora-modules: adapter name {m.name!r} is the base model's served name")
        seen.add(m.name)
    return modules
