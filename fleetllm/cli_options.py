"""Command-line flags generated from config dataclasses, so that every setting is defined once: as a field.

Every field of a config dataclass is a flag, documented where it is declared with :func:`opt`
(``max_num_seqs: int = opt(64, "most sequences running in one step")``), unless marked
``opt(..., cli=False)`` (set by code, e.g. a worker's metric labels):

- name: ``--max-num-seqs`` for ``max_num_seqs``; a trailing ``_s`` (the unit, seconds) is not part of
  the flag (``health_interval_s`` -> ``--health-interval``); ``opt(flag=...)`` names it otherwise;
- type from the annotation: ``int``, ``float``, ``str``; ``X | None`` takes an X (absent: None); a
  ``Literal`` gives the choices; ``list[X]`` takes comma-separated values (with ``opt(many=True)``: one flag
  with several values, also repeatable, as vLLM's ``--lora-modules A=x B=y``); ``dict[str, str]`` takes
  ``KEY=VALUE``, repeatable; ``bool`` is a switch: ``--x`` turns on a field that defaults to False,
  ``--no-x`` turns off one that defaults to True;
- default: the field's (a field without one is a required flag); help: the field's doc.

A flag's destination is always its field's name, so :func:`from_args` builds the dataclass from the
parsed namespace, and :func:`to_argv` writes one back as flags (e.g. for a worker's command line).
Stdlib only: the config modules built on it load no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar

C = TypeVar("C")


def opt(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING,
        flag: str | None = None, metavar: str | None = None, choices: Iterable[Any] | None = None,
        cli: bool = True, parse: Callable[[str], Any] | None = None, many: bool = False) -> Any:
    """A dataclass field with its doc, e.g. ``max_num_seqs: int = opt(64, "most sequences per step")``.

    ``factory`` replaces ``default`` for mutable values (``opt(doc="...", factory=list)``); ``flag`` names
    the flag when the field's name is not the flag's; ``choices`` when they are not a ``Literal``;
    ``cli=False`` for a field that is no flag; ``parse`` reads a value no annotation describes (a number or
    a word, say); ``many`` for a ``list[X]`` given as several values (``--flag a b --flag c``), not a,b,c.
    """
    meta = {"doc": doc, "flag": flag, "metavar": metavar, "cli": cli,
            "choices": tuple(choices) if choices else None, "parse": parse, "many": many}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags (every field not marked ``cli=False``)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def field_default(f: dataclasses.Field) -> Any:
    """The field's default value (a fresh one from its factory), or ``dataclasses.MISSING``."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def flag_name(f: dataclasses.Field) -> str:
    """``--max-num-seqs`` for ``max_num_seqs``; ``--no-x`` for a switch that defaults to True."""
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    name = f.name.removesuffix("_s").replace("_", "-")
    return f"--no-{name}" if field_default(f) is True else f"--{name}"


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                only: Iterable[str] | None = None, defaults: Mapping[str, Any] | None = None,
                title: str | None = None) -> None:
    """One flag per CLI field of the dataclass ``cls`` (or of the fields named in ``only``).

    ``defaults`` replaces a field's default on this parser only: ``None`` makes a flag an override of a
    value that comes from elsewhere (``fleetllm serve`` over its YAML); the help still shows the field's own.
    ``title`` groups the flags under a heading of ``--help`` (``parser`` may itself be a group).
    """
    target = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(cls)
    wanted = set(only) if only is not None else None
    defaults = defaults or {}
    unknown = ((wanted or set()) | set(defaults)) - {f.name for f in cli_fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__} has no CLI field {', '.join(sorted(unknown))}")
    for f in cli_fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        kwargs = _argument(f, hints[f.name], defaults.get(f.name, dataclasses.MISSING))
        target.add_argument(flag_name(f), dest=f.name, **kwargs)


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """``cls`` built from parsed flags: every CLI field the namespace holds, then ``overrides``."""
    values = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def to_argv(cfg: Any) -> list[str]:
    """The flags that give ``cfg`` back through :func:`from_args`: one per CLI field not at its default."""
    argv: list[str] = []
    for f in cli_fields(type(cfg)):
        value, default = getattr(cfg, f.name), field_default(f)
        if value == default:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f))
        elif isinstance(value, dict):
            argv += [x for k, v in value.items() for x in (flag_name(f), f"{k}={v}")]
        elif isinstance(value, list) and f.metadata.get("many"):
            argv += [flag_name(f), *map(str, value)] if value else []
        elif value is not None:
            argv += [flag_name(f), ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


def _argument(f: dataclasses.Field, annotation: Any, override: Any) -> dict[str, Any]:
    """``add_argument`` keywords for one field: default (``override`` if given), help, how to read it."""
    default = field_default(f)
    kind = _without_none(annotation)
    # an override of None defers to a value from elsewhere, which in the end is the field's default
    shown = default if override is None or override is dataclasses.MISSING else override
    kwargs: dict[str, Any] = {"help": _help(f, shown)}
    if override is not dataclasses.MISSING:
        kwargs["default"] = override
    elif default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
    if kind is bool:
        return {**kwargs, "action": "store_false" if default is True else "store_true"}
    kwargs.update(_value(f, kind))
    if f.metadata.get("metavar"):
        kwargs["metavar"] = f.metadata["metavar"]
    return kwargs


def _value(f: dataclasses.Field, kind: Any) -> dict[str, Any]:
    """How a flag's value is read (type and choices, or an action) and how ``--help`` names it."""
    origin = typing.get_origin(kind)
    if f.metadata.get("many"):
        item = f.metadata.get("parse") or typing.get_args(kind)[0]
        return {"type": item, "nargs": "+", "action": "extend"}
    if f.metadata.get("parse"):
        return {"type": f.metadata["parse"]}
    choices = f.metadata.get("choices") or (typing.get_args(kind) if origin is Literal else None)
    if choices:
        return {"type": type(choices[0]), "choices": choices}  # --help lists the choices
    if origin is list:
        return {"type": _comma_list(typing.get_args(kind)[0]), "metavar": "A,B,..."}
    if origin is dict:
        return {"action": _KeyValue, "metavar": "KEY=VALUE"}
    return {"type": kind, "metavar": flag_name(f).lstrip("-").upper().replace("-", "_")}


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``; the first member of any other union (``str | dict`` is given as a str)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _help(f: dataclasses.Field, default: Any) -> str:
    doc = f.metadata.get("doc", "").replace("%", "%%")  # argparse formats help with %
    if default is True:
        return f"{doc} (on unless this flag is given)".strip()
    empty = default is None or default is False or default is dataclasses.MISSING or default in ([], {})
    if empty or "default" in doc:
        return doc
    return f"{doc} (default: {default})".strip()


def _comma_list(item: type) -> Callable[[str], list[Any]]:
    """A parser of ``a,b,c``; empty items stay (a list given per worker keeps its positions)."""

    def comma_separated(text: str) -> list[Any]:
        return [item(x) for x in text.split(",")] if text else []

    return comma_separated


class _KeyValue(argparse.Action):
    """``--flag KEY=VALUE``, repeatable, into a dict."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        key, sep, val = str(value).partition("=")
        if not sep:
            parser.error(f"{option_string} takes KEY=VALUE, not {value!r}")
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), key: val})
