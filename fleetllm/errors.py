"""A user's mistake, as the ``fleetllm`` command reports it: one line on stderr, exit status 2, no traceback.

Code that checks what a person typed (a flag, a fleet YAML, a model reference, a file name) raises
:class:`UsageError` with a message that says what was wrong and what would be right; ``fleetllm``'s ``main``
prints it as ``fleetllm <command>: error: <message>``. Anything else that escapes a command is a bug and keeps
its traceback. ``UsageError`` is a ``ValueError``, so the callers that already refuse a ``ValueError`` (an HTTP
400, a config the Kubernetes renderer cannot take) keep doing so. Stdlib only: the CLI imports it first.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


class UsageError(ValueError):
    """A mistake in a command line or a config file; ``prog`` names the command when known
    (``fleetllm models pull``), else ``main`` names it from the command line."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean `x`?"`` with the choice nearest to ``word`` (difflib), or ``""`` when none is near."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean `{near[0]}`?" if near else ""


def unknown_key(path: str, known: Iterable[str]) -> str:
    """The message for a config key no schema has: its path (``models[0].enginee``) and the nearest valid key,
    or every valid key when none is near."""
    names = sorted(known)
    word = path.rsplit(".", 1)[-1]
    hint = did_you_mean(word, names) or f"; valid keys here: {', '.join(names)}"
    return f"unknown key `{path}`{hint}"


def yaml_error(path: str | Path, e: Exception) -> UsageError:
    """A YAML parser's error as one line: the file, line and column, and the problem (PyYAML's own message
    spans several lines, quoting the text)."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    return UsageError(f"{where}: not valid YAML: {problem or one_line(str(e))}")


def one_line(text: str) -> str:
    """``text`` on one line (an exception's message may hold newlines: a YAML parser's, a library's)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def existing_file(path: str | Path, what: str) -> Path:
    """``path`` as given by a user, refused in one line unless it is a file that exists (``what`` says which:
    "fleet YAML", "timing profile")."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"{what} {str(path)!r}: " + ("a directory, not a file" if p.is_dir() else "no such file"))
    return p
