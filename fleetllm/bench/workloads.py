"""Seeded workload generators: each yields ``Session``s, and a plain request is a one-turn session.

Invariants: the same seed gives the same sessions (every generator draws only from its own
``numpy.random.Generator``); turns of a session are sent in order, each resending the whole history
(system text, earlier user turns and the replies actually received), so sessions really grow.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fleetllm.bench.tokens import CODE_WORDS, PROSE_WORDS


@dataclass
class Turn:
    """One request of a session: the new user content and its output budget."""

    content: str
    max_tokens: int
    input_tokens: int = 0  # tokens of ``content`` alone, as sized by the generator
    think_time_s: float = 0.0  # pause after the previous reply, before sending this turn
    messages: list[dict[str, str]] | None = None  # a verbatim conversation (trace/file), no history
    body: dict[str, Any] | None = None  # request fields of this turn only (e.g. a response_format)


@dataclass
class Session:
    """A user's conversation; ``arrival_s`` is set only by trace replay (offset from the start)."""

    session_id: str
    turns: list[Turn]
    system: str | None = None
    system_tokens: int = 0
    arrival_s: float | None = None


class Workload(Protocol):
    """Anything that yields sessions for a seed; generators are infinite, files are finite."""

    name: str

    def sessions(self, seed: int) -> Iterator[Session]: ...


@dataclass
class PromptBuilder:
    """Builds text of a target token length from a word list, given measured tokens per word."""

    prose_tokens_per_word: float = 1.0
    code_tokens_per_word: float = 1.0

    def text(self, rng: np.random.Generator, n_tokens: int, code: bool = False) -> str:
        words, tpw = (CODE_WORDS, self.code_tokens_per_word) if code else (PROSE_WORDS, self.prose_tokens_per_word)
        n_words = max(1, round(n_tokens / tpw))
        return " ".join(words[i] for i in rng.integers(0, len(words), size=n_words))


def _normal_len(rng: np.random.Generator, mean: float, std: float) -> int:
    return max(1, round(rng.normal(mean, std))) if std > 0 else max(1, round(mean))


@dataclass
class SyntheticWorkload:
    """Single-turn prompts with ISL/OSL ~ Normal(mean, std), or a weighted mix of (ISL, OSL) classes."""

    builder: PromptBuilder
    isl_mean: float = 512
    isl_std: float = 0
    osl_mean: float = 128
    osl_std: float = 0
    mix: list[tuple[int, int, float]] = field(default_factory=list)  # (isl, osl, weight)
    name: str = "synthetic"

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng(seed)
        weights = np.array([w for _, _, w in self.mix], dtype=float)
        i = 0
        while True:
            if self.mix:
                isl, osl, _ = self.mix[rng.choice(len(self.mix), p=weights / weights.sum())]
                isl = _normal_len(rng, isl, self.isl_std)
                osl = _normal_len(rng, osl, self.osl_std)
            else:
                isl = _normal_len(rng, self.isl_mean, self.isl_std)
                osl = _normal_len(rng, self.osl_mean, self.osl_std)
            yield Session(f"s{i}", [Turn(self.builder.text(rng, isl), osl, isl)])
            i += 1


def long_short_workload(
    builder: PromptBuilder,
    long_isl: int = 4096,
    long_osl: int = 64,
    short_isl: int = 256,
    short_osl: int = 128,
    long_fraction: float = 0.2,
) -> SyntheticWorkload:
    """A stream mixing long prompts into short ones: the traffic that disaggregation is for."""
    mix = [(long_isl, long_osl, long_fraction), (short_isl, short_osl, 1.0 - long_fraction)]
    return SyntheticWorkload(builder, mix=mix, name="long-short")


@dataclass
class SharedPrefixWorkload:
    """N system prompts of ``prefix_len`` tokens, picked with Zipf(s) popularity, plus unique suffixes."""

    builder: PromptBuilder
    num_prefixes: int = 8
    prefix_len: int = 1024
    suffix_len: int = 64
    osl: int = 64
    zipf_s: float = 1.0
    name: str = "shared-prefix"

    def popularity(self) -> np.ndarray:
        """P(prefix i) proportional to 1 / (i+1)^s."""
        p = 1.0 / np.arange(1, self.num_prefixes + 1) ** self.zipf_s
        return p / p.sum()

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng(seed)
        prefixes = [self.builder.text(rng, self.prefix_len) for _ in range(self.num_prefixes)]
        p = self.popularity()
        i = 0
        while True:
            k = int(rng.choice(self.num_prefixes, p=p))
            suffix = self.builder.text(rng, self.suffix_len)
            turn = Turn(suffix, self.osl, self.suffix_len)
            yield Session(f"s{i}-p{k}", [turn], system=prefixes[k], system_tokens=self.prefix_len)
            i += 1


@dataclass
class MultiTurnWorkload:
    """Chat sessions: a number of turns, think time between them; each turn resends the history."""

    builder: PromptBuilder
    turns_mean: float = 4
    turns_std: float = 0
    user_isl: int = 128
    osl: int = 64
    think_time_s: float = 0.0
    system_len: int = 0
    shared_systems: int = 0  # > 0: each session's system prompt is one of this many shared ones
    name: str = "multi-turn"

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng(seed)
        shared = [self.builder.text(rng, self.system_len) for _ in range(self.shared_systems)] if self.system_len else []
        i = 0
        while True:
            n = _normal_len(rng, self.turns_mean, self.turns_std)
            turns = [
                Turn(self.builder.text(rng, self.user_isl), self.osl, self.user_isl, self.think_time_s if t else 0.0)
                for t in range(n)
            ]
            if shared:
                system: str | None = shared[int(rng.integers(len(shared)))]
            else:
                system = self.builder.text(rng, self.system_len) if self.system_len else None
            yield Session(f"s{i}", turns, system=system, system_tokens=self.system_len)
            i += 1


# the agent's tools, as a coding agent's system prompt lists them (their schema is part of the shared prefix)
AGENT_TOOLS = [
    {"name": name, "description": desc, "parameters": {"type": "object", "properties": props,
                                                        "required": list(props)}}
    for name, desc, props in [
        ("read_file", "Read a file of the repository", {"path": {"type": "string"}}),
        ("grep", "Search the repository for a pattern", {"pattern": {"type": "string"}, "path": {"type": "string"}}),
        ("run_tests", "Run the test suite, or one test file", {"target": {"type": "string"}}),
        ("edit_file", "Replace text in a file", {"path": {"type": "string"}, "old": {"type": "string"},
                                                 "new": {"type": "string"}}),
        ("shell", "Run a shell command", {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}),
    ]
]


@dataclass
class AgenticWorkload:
    """Agent sessions: a system prompt shared by every session (instructions and the tool schema,
    ``system_len`` tokens), the session's own task context (``context_len`` tokens of code), then turns
    each appending a tool output of ``step_len`` tokens (uniform up to ``step_len_max`` when larger), with
    ``think_time_s`` between a reply and the next turn. A session ends after ``turns`` turns or before its
    context (prompt and outputs so far, plus the next turn) would pass ``max_context`` tokens (0: no limit).
    """

    builder: PromptBuilder
    context_len: int = 4096
    turns: int = 8
    step_len: int = 256  # tokens of tool output appended each turn
    osl: int = 32
    think_time_s: float = 0.0
    system_len: int = 0  # the shared system prompt (0: none, the session's context alone)
    step_len_max: int = 0
    max_context: int = 0
    name: str = "agentic"

    def shared_system(self) -> str:
        """The same for every seed and session: what a fleet can keep cached for all its agents."""
        if not self.system_len:
            return ""
        schema = json.dumps(AGENT_TOOLS)
        intro = "You are a coding agent. Call one tool per turn as JSON. Tools: " + schema + "\n"
        pad = self.system_len - len(schema) // 4  # about 4 characters per token of JSON
        return intro + (self.builder.text(np.random.default_rng(0), pad) if pad > 0 else "")

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng(seed)
        shared = self.shared_system()
        i = 0
        while True:
            context = self.builder.text(rng, self.context_len, code=True)
            system = shared + "\n\n" + context if shared else context
            size = self.system_len + self.context_len
            turns: list[Turn] = []
            for t in range(self.turns):
                step = int(rng.integers(self.step_len, self.step_len_max + 1)) if self.step_len_max > self.step_len \
                    else self.step_len
                if self.max_context and turns and size + step + self.osl > self.max_context:
                    break
                size += step + self.osl
                text = f"tool result: call_{t} " + self.builder.text(rng, step, code=True)
                turns.append(Turn(text, self.osl, step, self.think_time_s if t else 0.0))
            yield Session(f"s{i}", turns, system=system, system_tokens=self.system_len + self.context_len)
            i += 1


@dataclass
class PromptFileWorkload:
    """Prompts from a file: plain text (one per line) or JSONL with ``prompt``/``text``/``messages``."""

    path: Path
    osl: int = 128
    name: str = "prompt-file"

    def sessions(self, seed: int) -> Iterator[Session]:
        del seed  # the file fixes the order
        for i, line in enumerate(_nonblank_lines(self.path)):
            if self.path.suffix == ".jsonl":
                yield Session(f"s{i}", [_turn_from_body(json.loads(line), self.osl)])
            else:
                yield Session(f"s{i}", [Turn(line, self.osl)])


@dataclass
class TraceWorkload:
    """Replays a JSONL trace with timestamps: generic/Mooncake-style lines or SageMaker data capture
    (one file, or a whole capture directory, local or ``s3://bucket/prefix``).

    Generic lines carry ``timestamp`` (ms) or ``timestamp_s``, ``input_length``/``output_length``
    (or ``prompt``/``messages``/``max_tokens``) and optional Mooncake ``hash_ids``: blocks with the same
    id get the same text, so the trace's prefix sharing is reproduced.
    """

    path: Path | str  # a file, a capture directory, or s3://bucket/prefix
    builder: PromptBuilder
    speedup: float = 1.0
    default_osl: int = 128
    block_tokens: int = 512
    name: str = "trace"

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng(seed)
        t0: float | None = None
        for i, row in enumerate(self._rows()):
            if "captureData" in row:
                ts, turn = _sagemaker_turn(row, self.default_osl)
            else:
                ts, turn = self._generic_turn(row, rng)
            t0 = ts if t0 is None else t0
            yield Session(str(row.get("session_id", f"s{i}")), [turn], arrival_s=(ts - t0) / self.speedup)

    def _rows(self) -> Iterator[dict[str, Any]]:
        """The trace's lines; for a capture directory (local or ``s3://``), every endpoint-tier record of
        every object, in arrival order."""
        if str(self.path).startswith("s3://") or Path(self.path).is_dir():
            from fleetllm.capture.reader import CaptureSource

            # requests the fleet refused as malformed (4xx) are not traffic to replay
            rows = [r for _, _, r in CaptureSource(str(self.path)).records("endpoint")
                    if not 400 <= ((r.get("fleetllm") or {}).get("status") or 200) < 500]
            yield from sorted(rows, key=lambda r: r["eventMetadata"].get("inferenceTime") or "")
            return
        for line in _nonblank_lines(Path(self.path)):
            yield json.loads(line)

    def _generic_turn(self, row: dict[str, Any], rng: np.random.Generator) -> tuple[float, Turn]:
        ts = float(row["timestamp_s"]) if "timestamp_s" in row else float(row.get("timestamp", 0)) / 1000.0
        if "prompt" in row or "messages" in row:
            return ts, _turn_from_body(row, self.default_osl)
        isl = int(row.get("input_length", row.get("input_tokens", 128)))
        osl = int(row.get("output_length", row.get("output_tokens", self.default_osl)))
        blocks = [
            self.builder.text(np.random.default_rng(int(h)), self.block_tokens) for h in row.get("hash_ids", [])
        ]
        rest = isl - self.block_tokens * len(blocks)
        if rest > 0 or not blocks:
            blocks.append(self.builder.text(rng, max(rest, 1)))
        return ts, Turn(" ".join(blocks), osl, isl)


def _nonblank_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line.rstrip("\n")


def _turn_from_body(body: dict[str, Any], default_osl: int) -> Turn:
    """A turn from an OpenAI- or TGI-shaped request body."""
    params = body.get("parameters") or {}
    osl = int(body.get("max_tokens") or body.get("max_completion_tokens") or params.get("max_new_tokens") or default_osl)
    if body.get("messages"):
        return Turn("", osl, messages=body["messages"])
    return Turn(str(body.get("prompt") or body.get("text") or body.get("inputs") or ""), osl)


def _decode_capture(part: dict[str, Any]) -> Any:
    data = part.get("data", "")
    if part.get("encoding", "").upper() == "BASE64":
        data = base64.b64decode(data).decode("utf-8")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, TypeError):
        return data


def _sagemaker_turn(row: dict[str, Any], default_osl: int) -> tuple[float, Turn]:
    """A SageMaker data-capture line: ``captureData.endpointInput`` holds the request body."""
    capture = row["captureData"]
    body = _decode_capture(capture.get("endpointInput", {}))
    if not isinstance(body, dict):
        body = {"prompt": str(body)}
    if not (body.get("max_tokens") or (body.get("parameters") or {}).get("max_new_tokens")):
        out = _decode_capture(capture.get("endpointOutput", {}))
        if isinstance(out, dict) and (out.get("usage") or {}).get("completion_tokens"):
            body = {**body, "max_tokens": out["usage"]["completion_tokens"]}
    when = (row.get("eventMetadata") or {}).get("inferenceTime")
    ts = datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp() if when else 0.0
    return ts, _turn_from_body(body, default_osl)
