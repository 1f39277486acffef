"""Where an engine step's time goes: seconds per phase, summed over steps (``--profile-steps``, off by default).

Phases, in step order: ``schedule`` (the scheduler), ``prepare`` (the runner turning the batch into
tensors), ``forward`` (the decoder stack, ``attention`` included), ``attention`` (the attention modules'
time, part of ``forward``: q/k/v/o projections, RoPE, the KV store, attention), ``logits`` (the LM head
over the sampling rows),
``sampling`` (sampler, draft verification, the copy to the host), ``update`` (appends, detokenizing, stop checks, outputs,
metrics) and ``propose`` (drafting). ``other`` is the rest of the step's wall time.

Torch-free; the executor that runs a model adds its own phases (and the attention timers) when one is set.
Off, the engine only reads the clock a few times per step and adds nothing.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext

PHASES = ("schedule", "prepare", "forward", "attention", "logits", "sampling", "update", "propose")


class StepProfile:
    """Per-phase seconds and the step count since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.wall = 0.0  # whole steps
        self.steps = 0
        self.tokens = 0  # tokens sampled (emitted) over those steps

    def reset(self) -> None:
        """Forget what was measured (e.g. after prefill, to see decode steps alone)."""
        self.__init__()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def step_done(self, seconds: float, tokens: int) -> None:
        self.wall += seconds
        self.steps += 1
        self.tokens += tokens

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase, ``other`` (step wall minus the disjoint phases) and
        ``step`` (the whole step); ``outside_forward`` is the engine's own work (step minus forward and logits)."""
        n = max(self.steps, 1)
        ms = {k: 1e3 * v / n for k, v in self.seconds.items()}
        disjoint = sum(v for k, v in ms.items() if k != "attention")
        ms["step"] = 1e3 * self.wall / n
        ms["other"] = max(0.0, ms["step"] - disjoint)
        ms["outside_forward"] = ms["step"] - ms["forward"] - ms["logits"]
        return ms

    def summary(self) -> str:
        """One line: ms per step of each phase."""
        ms = self.per_step_ms()
        parts = [f"{k} {ms[k]:.2f}" for k in ("step", *PHASES, "other", "outside_forward")]
        return f"{self.steps} steps, ms/step: " + ", ".join(parts)


class _Phase:
    __slots__ = ("profile", "name", "t0")

    def __init__(self, profile: StepProfile, name: str) -> None:
        self.profile, self.name, self.t0 = profile, name, 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.profile.add(self.name, time.perf_counter() - self.t0)


def phase(profile: StepProfile | None, name: str) -> AbstractContextManager[None]:
    """``with phase(profile, "forward"):`` adds the block's seconds to ``profile``; nothing when it is None."""
    return _NULL if profile is None else _Phase(profile, name)


_NULL = nullcontext()
