"""The traffic to plan for, as lengths: prompt and output token samples and how much of a prompt is reusable.

From a ``fleetllm bench`` workload name (the same shapes ``fleetllm/bench/workloads.py`` generates), an
ISL/OSL distribution (``isl=512:128,osl=128:32``: mean:std), or a capture directory (SageMaker JSONL, the
data capture's endpoint tier), whose real prompt and output lengths and shared prompt prefixes are used.

Reusable prompt tokens come in two kinds: *shared* (system prompts many sessions send: any replica
that served one of them holds it) and *private* (a session's own history: only the replica that served
its previous turn holds it, so routing decides whether it is a hit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fleetllm.errors import UsageError

CHARS_PER_TOKEN = 4.0  # to size captured prompts given as text without a token count
SAMPLES = 2000


@dataclass
class WorkloadShape:
    name: str
    isl: np.ndarray
    osl: np.ndarray
    shared_prefix: float = 0.0  # fraction of prompt tokens cached on any replica that has seen the prefix
    private_prefix: float = 0.0  # fraction cached only on the replica that served the session's last turn
    category: str = "chat"  # chat | code | agentic: what speculation's acceptance is measured on
    params: dict[str, float] = field(default_factory=dict)  # what built it (for `fleetllm bench`)

    @property
    def isl_mean(self) -> float:
        return self._means[0]

    @property
    def osl_mean(self) -> float:
        return self._means[1]

    @property
    def turns(self) -> int:
        """Requests per session: a session's next turn is sent when its last one ends, with the history."""
        return max(1, int(self.params.get("turns", 1))) if self.name in ("multi-turn", "agentic") else 1

    def __post_init__(self) -> None:
        self._pct: dict[tuple, Any] = {}
        self._means = (float(self.isl.mean()), float(self.osl.mean()))

    def isl_pct(self, q: float) -> float:
        if ("isl", q) not in self._pct:
            self._pct["isl", q] = float(np.percentile(self.isl, q))
        return self._pct["isl", q]

    def osl_pct(self, q: float) -> float:
        if ("osl", q) not in self._pct:
            self._pct["osl", q] = float(np.percentile(self.osl, q))
        return self._pct["osl", q]

    def hit_fraction(self, affinity: bool, replicas: int) -> float:
        """Fraction of prompt tokens served from the prefix cache, by whether routing keeps sessions together."""
        return self.shared_prefix + self.private_prefix * (1.0 if affinity or replicas == 1 else 1.0 / replicas)

    def fraction_at_least(self, tokens: int, hit: float) -> float:
        """Fraction of requests whose uncached prompt is at least ``tokens`` long (P/D's threshold)."""
        return self._long(tokens, hit)[0]

    def mean_isl_at_least(self, tokens: int, hit: float) -> float:
        """Mean prompt length of the requests whose uncached prompt is at least ``tokens`` long."""
        return self._long(tokens, hit)[1]

    def _long(self, tokens: int, hit: float) -> tuple[float, float]:
        key = ("long", tokens, hit)
        if key not in self._pct:
            mask = self.isl * (1 - hit) >= tokens
            self._pct[key] = (float(mask.mean()), float(self.isl[mask].mean()) if mask.any() else 0.0)
        return self._pct[key]


def _lengths(rng: np.random.Generator, mean: float, std: float) -> np.ndarray:
    if std <= 0:
        return np.full(SAMPLES, max(1, round(mean)), dtype=float)
    return np.maximum(1, np.round(rng.normal(mean, std, SAMPLES)))


def from_bench(name: str, isl: float = 512, osl: float = 128, isl_std: float = 0, osl_std: float = 0,
               prefix_len: int = 1024, turns: float = 4, system_len: int = 0, context_len: int = 4096,
               step_len: int = 256, long_isl: int = 4096, long_osl: int = 64, long_fraction: float = 0.2,
               seed: int = 0) -> WorkloadShape:
    """The lengths a ``fleetllm bench --workload NAME`` run with the same parameters sends."""
    rng = np.random.default_rng(seed)
    params = {"isl": isl, "osl": osl, "isl_std": isl_std, "osl_std": osl_std}
    if name == "synthetic":
        return WorkloadShape(name, _lengths(rng, isl, isl_std), _lengths(rng, osl, osl_std), params=params)
    if name == "shared-prefix":
        total = np.full(SAMPLES, prefix_len + isl)
        return WorkloadShape(name, total, _lengths(rng, osl, 0), shared_prefix=prefix_len / (prefix_len + isl),
                             params={**params, "prefix_len": prefix_len})
    if name == "long-short":
        long = rng.random(SAMPLES) < long_fraction
        return WorkloadShape(name, np.where(long, long_isl, isl).astype(float), np.where(long, long_osl, osl).astype(float),
                             params={**params, "long_isl": long_isl, "long_osl": long_osl, "long_fraction": long_fraction})
    if name in ("multi-turn", "agentic"):
        n, user, base, out = (int(turns), isl, system_len, osl) if name == "multi-turn" else (int(turns), step_len, context_len, osl)
        t = np.arange(n)
        prompt = base + (t + 1) * user + t * out  # turn t resends the history
        # what turn t finds cached where turn t-1 ran: turn t-1's prompt; the answer comes back as text,
        # re-tokenized inside the chat template, and misses (the fleet's cached_tokens end there)
        history = np.concatenate([[0], prompt[:-1]])
        reps = SAMPLES // n + 1
        return WorkloadShape(name, np.tile(prompt, reps)[:SAMPLES].astype(float), np.full(SAMPLES, float(out)),
                             private_prefix=float(history.sum() / prompt.sum()),
                             category="agentic" if name == "agentic" else "chat",
                             params={**params, "turns": turns, "system_len": system_len, "context_len": context_len,
                                     "step_len": step_len})
    raise UsageError(f"unknown workload {name!r}: a bench workload (synthetic, shared-prefix, multi-turn, "
                     "agentic, long-short), isl=MEAN:STD,osl=MEAN:STD, or a capture directory")


def from_distribution(text: str, seed: int = 0) -> WorkloadShape:
    """``isl=512:128,osl=128:32`` (mean:std, std optional)."""
    rng = np.random.default_rng(seed)
    parts = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    if set(parts) != {"isl", "osl"}:
        raise UsageError(f"--workload {text!r}: a distribution is isl=MEAN[:STD],osl=MEAN[:STD]")
    isl_mean, _, isl_std = parts["isl"].partition(":")
    osl_mean, _, osl_std = parts["osl"].partition(":")
    return WorkloadShape(text, _lengths(rng, float(isl_mean), float(isl_std or 0)),
                         _lengths(rng, float(osl_mean), float(osl_std or 0)),
                         params={"isl": float(isl_mean), "osl": float(osl_mean), "isl_std": float(isl_std or 0),
                                 "osl_std": float(osl_std or 0)})


def from_capture(path: str) -> WorkloadShape:
    """Real lengths of a capture directory's requests; a system message sent by many is a shared prefix."""
    from fleetllm.bench.workloads import PromptBuilder, TraceWorkload

    isl, osl, systems, system_tokens = [], [], {}, []
    for session in TraceWorkload(path, PromptBuilder()).sessions(0):
        turn = session.turns[0]
        messages = turn.messages or [{"role": "user", "content": turn.content}]
        text = "".join(str(m.get("content", "")) for m in messages)
        isl.append(max(1.0, turn.input_tokens or len(text) / CHARS_PER_TOKEN))
        osl.append(float(turn.max_tokens))
        system = next((str(m.get("content", "")) for m in messages if m.get("role") == "system"), "")
        systems[system] = systems.get(system, 0) + 1
        system_tokens.append((system, len(system) / CHARS_PER_TOKEN))
    if not isl:
        raise ValueError(f"{path}: no captured requests")
    shared = sum(t for s, t in system_tokens if s and systems[s] > 1)
    return WorkloadShape(Path(path).name or path, np.array(isl), np.array(osl), shared_prefix=min(0.95, shared / sum(isl)))


def load_workload(spec: str, template_tokens: int = 0, **bench_params: float) -> WorkloadShape:
    """A bench workload name, an ``isl=...,osl=...`` distribution, or a capture directory (local or s3://);
    ``template_tokens``: what the chat template adds to every prompt (not in bench's or a capture's counts)."""
    if spec.startswith("isl="):
        w = from_distribution(spec)
    elif spec.startswith("s3://") or Path(spec).is_dir():
        w = from_capture(spec)
    else:
        w = from_bench(spec, **bench_params)
    return with_template(w, template_tokens)


def with_template(w: WorkloadShape, tokens: int) -> WorkloadShape:
    """``w`` with ``tokens`` more in every prompt (the chat template's, a shared prefix of every request)."""
    if not tokens:
        return w
    isl = w.isl + tokens
    scale = w.isl.mean() / isl.mean()
    return WorkloadShape(w.name, isl, w.osl, w.shared_prefix * scale, w.private_prefix * scale, w.category, w.params)
