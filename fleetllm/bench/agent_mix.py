"""Agent sessions whose replies are what agents really write: edited files, quoted tool output, JSON tool calls.

The ``agentic`` workload's tool outputs are word salad and its replies a fixed number of tokens, so a small model
answers them with whatever loop greedy decoding falls into. Here each turn gives the model a real tool output and
an instruction whose answer is mostly already in the context, as in an agent's loop:

- ``edit``: a ``read_file`` result (a function of the Python standard library, real code) and "rewrite it with
  line N changed to ..."; the reply repeats the file (a code edit).
- ``quote``: a ``run_tests`` report as JSON (test ids, outcomes, errors, durations) and "list the failed tests
  with their errors, copied exactly", the reply held to a JSON schema (a ``response_format``).
- ``call``: a ``grep`` result and "call the next tool", the reply a tool call held to the tools' JSON schema, as
  agents get them; its keys repeat turn after turn.

Replies end where the model ends them (EOS, so the client sends no ``ignore_eos``), capped by each kind's
``max_tokens``. The system prompt (instructions and the tool schema) is shared by every session; a session ends
before its context would pass ``max_context`` tokens. Seeded: the same seed gives the same sessions.
"""

from __future__ import annotations

import json
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from fleetllm.bench.workloads import AGENT_TOOLS, Session, Turn

# standard-library modules whose functions are the repository being edited (stable for a Python version)
MODULES = ("textwrap", "shlex", "fnmatch", "glob", "bisect", "heapq", "calendar", "difflib", "string", "netrc",
           "json/encoder", "json/decoder", "csv", "configparser", "argparse", "gettext", "ipaddress", "statistics")
KINDS = ("edit", "quote", "call")
WEIGHTS = (0.4, 0.3, 0.3)
CHARS_PER_TOKEN = 3.2  # code and JSON under SmolLM2's and Gemma's tokenizers, about
SYSTEM = ("You are a coding agent in a Python repository. Tools: " + json.dumps([t["name"] for t in AGENT_TOOLS])
          + ". Copy code and data exactly when asked.")
FAILURES = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "string"}, "error": {"type": "string"}}, "required": ["id", "error"]}}
CALL = {"type": "object", "properties": {"tool": {"enum": [t["name"] for t in AGENT_TOOLS]},
                                         "args": {"type": "object", "properties": {"path": {"type": "string"}},
                                                  "required": ["path"]}}, "required": ["tool", "args"]}


def json_reply(name: str, schema: dict) -> dict:
    """The request fields that make a reply JSON of ``schema`` (how agents get tool calls)."""
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}


@cache
def functions() -> tuple[tuple[str, str], ...]:
    """(path, source) of every top-level function or method of ``MODULES`` with 8 to 60 lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod in MODULES:
        path = root / f"{mod}.py"
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"^( *)def \w+\(.*?(?=^\1(?:def |class )|^\S|\Z)", text, re.M | re.S):
            body = m.group(0).rstrip()
            if 8 <= body.count("\n") + 1 <= 60:
                out.append((f"lib/{mod}.py", body))
    return tuple(out)


def tokens_of(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


@dataclass
class AgentMixWorkload:
    """Agent sessions of ``edit`` / ``quote`` / ``call`` turns (see the module's docstring)."""

    max_context: int = 8192
    turns: int = 64
    think_time_s: float = 0.0
    name: str = "agent-mix"

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng(seed)
        i = 0
        while True:
            yield self._session(rng, f"s{i}")
            i += 1

    def _session(self, rng: np.random.Generator, sid: str) -> Session:
        size, turns = tokens_of(SYSTEM), []
        for t in range(self.turns):
            kind = KINDS[int(rng.choice(len(KINDS), p=WEIGHTS))]
            content, max_tokens, body = TURNS[kind](rng)
            step = tokens_of(content)
            if turns and size + step + max_tokens > self.max_context:
                break
            size += step + max_tokens
            turns.append(Turn(content, max_tokens, step, self.think_time_s if t else 0.0, body=body))
        return Session(sid, turns, system=SYSTEM, system_tokens=tokens_of(SYSTEM))


def edit_turn(rng: np.random.Generator) -> tuple[str, int, dict | None]:
    """A function read from the repository and one line of it to change: the reply repeats the function."""
    fns = functions()
    path, body = fns[int(rng.integers(len(fns)))]
    lines = body.split("\n")
    n = int(rng.integers(1, len(lines)))
    indent = lines[n][: len(lines[n]) - len(lines[n].lstrip())]
    new = f"{indent}log.debug({json.dumps(lines[n].strip()[:40])})"
    text = (f"Copy this code exactly, but with line {n + 1} replaced by `{new.strip()}`:\n"
            f"```python\n{body}\n```")
    return text, tokens_of(body) + 48, None


def quote_turn(rng: np.random.Generator) -> tuple[str, int, dict | None]:
    """A test run's JSON report; the reply copies its failures."""
    fns = functions()
    tests, failures = [], []
    for _ in range(int(rng.integers(6, 16))):
        path, body = fns[int(rng.integers(len(fns)))]
        name = re.match(r"\s*def (\w+)", body).group(1)
        test = {"id": f"tests/test_{Path(path).stem}.py::test_{name}", "outcome": "passed",
                "duration_s": round(float(rng.uniform(0.01, 2.5)), 3)}
        if rng.random() < 0.3:
            test["outcome"] = "failed"
            test["error"] = f"AssertionError: {name}() returned {int(rng.integers(0, 100))}, expected {int(rng.integers(0, 100))}"
            failures.append(test)
        tests.append(test)
    report = json.dumps({"summary": {"total": len(tests), "failed": len(failures)}, "tests": tests}, indent=1)
    text = f"Here is a test report:\n{report}\nList the failed tests with their errors, copied exactly, as JSON."
    return text, max(64, tokens_of(json.dumps(failures)) + 32), json_reply("failures", FAILURES)


def call_turn(rng: np.random.Generator) -> tuple[str, int, dict | None]:
    """A grep result; the reply is the next tool call, as JSON."""
    fns = functions()
    hits = []
    for _ in range(int(rng.integers(3, 9))):
        path, body = fns[int(rng.integers(len(fns)))]
        lines = body.split("\n")
        n = int(rng.integers(len(lines)))
        hits.append(f"{path}:{n + 1}:{lines[n].strip()}")
    text = ('Here is the result of grep {"pattern": "def ", "path": "lib/"}:\n' + "\n".join(hits) + "\n"
            "Call the next tool: read the first file listed.")
    return text, 64, json_reply("tool_call", CALL)


TURNS = {"edit": edit_turn, "quote": quote_turn, "call": call_turn}
