"""The autoscaler: from a model's load signals to the number of copies it should have.

Each tick the fleet controller hands in one :class:`Signals` per model (summed or averaged over its ready
copies). The copies a model needs come from its concurrency (requests running or waiting per copy, against
``concurrency_per_copy``): it grows and shrinks in proportion to copies, so it sizes the model both ways by
Kubernetes HPA's rule ``ceil(copies * signal / target)``, within a 10% tolerance. The SLO guards, waiting
requests per copy (vLLM production-stack's KEDA trigger), KV-cache usage (AIBrix), TTFT and ITL p90 against
the model's targets (Dynamo's planner), and the hottest LoRA adapter's requests per copy (SageMaker's
per-adapter target, ``adapter_concurrency_per_copy``) only push up: a latency far under its target does not mean
copies can go in proportion (queueing is not linear), so they never shrink a model. The signal that
decided is the decision's reason.

Stabilisation (as HPA): a scale-up takes the *lowest* recommendation of the last ``up_window_s`` (a spike
must last), a scale-down the *highest* of the last ``down_window_s`` (a lull must last); after any change
no other change for ``cooldown_s``. A model with ``min: 0`` goes to zero after ``idle_s`` without requests,
and comes back to one copy as soon as a request is held for it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

TOLERANCE = 0.1  # a ratio within 10% of 1 asks for no change (HPA's default): no flapping around a target


@dataclass
class ScalingPolicy:
    """A model's autoscaling targets and windows (the ``autoscale:`` block of a model in the fleet YAML)."""

    concurrency_per_copy: float = 8.0  # requests running or waiting per copy the model is sized for
    waiting_per_copy: float = 5.0  # queued requests per copy
    kv_usage: float = 0.85  # fraction of KV blocks in use
    ttft_p90_s: float | None = None  # SLO: time to first token, 90th percentile
    itl_p90_s: float | None = None  # SLO: inter-token latency, 90th percentile
    up_window_s: float = 0.0
    down_window_s: float = 60.0
    cooldown_s: float = 10.0
    idle_s: float = 300.0  # min: 0 models unload after this long without requests
    # requests of any one LoRA adapter running or waiting per copy (SageMaker's per-adapter inference component
    # target): a hot adapter scales its base model's copies even while the model's total concurrency is in bounds
    # (adapter rows skip the fused C decode stack: a copy serves fewer of them at the same latency). None: off
    adapter_concurrency_per_copy: float | None = None


@dataclass
class Signals:
    """A model's load over the last tick."""

    copies: int  # ready copies now
    waiting: float = 0.0  # requests queued on its workers (sum)
    running: float = 0.0  # requests being served (sum)
    held: int = 0  # requests held by the router while no copy is ready
    kv_usage: float = 0.0  # mean over copies
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    request_rate: float = 0.0  # requests per second arriving
    concurrency: float | None = None  # mean requests in the system over the tick (else running + waiting now)
    adapters: dict[str, float] = field(default_factory=dict)  # requests in flight per LoRA adapter (sum)


@dataclass
class Decision:
    desired: int
    direction: str  # up | down | none
    reason: str  # the signal that decided (waiting, kv, ttft, itl, adapter, idle, held, min, max, cooldown, window)
    ratios: dict[str, float] = field(default_factory=dict)


class Autoscaler:
    """Desired copies of one model, between ``min_copies`` and ``max_copies``."""

    def __init__(self, policy: ScalingPolicy, min_copies: int, max_copies: int, clock: Any = time.monotonic) -> None:
        self.policy, self.min, self.max, self.clock = policy, min_copies, max_copies, clock
        self._history: deque[tuple[float, int]] = deque()  # (time, raw recommendation)
        self._last_change = -math.inf  # for the cooldown
        self._stable_since = clock()  # a scale-down needs a whole window of lower recommendations since then
        self._last_request = clock()

    def decide(self, s: Signals) -> Decision:
        """The copy count to aim for now, and why (call once per tick)."""
        now, p = self.clock(), self.policy
        if s.request_rate > 0 or s.held or s.waiting or s.running:
            self._last_request = now
        if s.copies == 0:  # scale from zero: a held request brings one copy at once
            want = max(self.min, 1 if s.held else 0)
            return self._settle(0, want, "held" if s.held else "idle", {}, now, cooldown=False)
        ratios = self._ratios(s)
        reason, raw = _recommend(s.copies, ratios)
        self._history.append((now, raw))
        while self._history and self._history[0][0] < now - max(p.up_window_s, p.down_window_s):
            self._history.popleft()
        want = min(r for t, r in self._history if t >= now - p.up_window_s)  # a spike must last up_window_s
        if want <= s.copies:
            want = min(s.copies, max(r for t, r in self._history if t >= now - p.down_window_s))  # a lull too
            if want < s.copies and now - self._stable_since < p.down_window_s:
                want, reason = s.copies, "window"
        floor = self.min or 1  # a min: 0 model keeps one copy until it has been idle for idle_s
        if self.min == 0 and now - self._last_request >= p.idle_s:
            want, reason = 0, "idle"
        elif want < floor:
            want, reason = floor, "min"
        elif want > self.max:
            want, reason = self.max, "max"
        return self._settle(s.copies, want, reason, ratios, now)

    def _ratios(self, s: Signals) -> dict[str, float]:
        p = self.policy
        busy = s.concurrency if s.concurrency is not None else s.running + s.waiting
        r = {"concurrency": busy / s.copies / p.concurrency_per_copy,
             "waiting": s.waiting / s.copies / p.waiting_per_copy, "kv": s.kv_usage / p.kv_usage}
        if p.ttft_p90_s and s.ttft_p90_s is not None:
            r["ttft"] = s.ttft_p90_s / p.ttft_p90_s
        if p.itl_p90_s and s.itl_p90_s is not None:
            r["itl"] = s.itl_p90_s / p.itl_p90_s
        if p.adapter_concurrency_per_copy and s.adapters:  # the hottest adapter's
            r["adapter"] = max(s.adapters.values()) / s.copies / p.adapter_concurrency_per_copy
        return r

    def _settle(self, copies: int, want: int, reason: str, ratios: dict[str, float], now: float,
                cooldown: bool = True) -> Decision:
        if want == copies:
            return Decision(copies, "none", reason, ratios)
        if cooldown and now - self._last_change < self.policy.cooldown_s:
            return Decision(copies, "none", "cooldown", ratios)
        self._last_change = self._stable_since = now
        self._history.clear()  # recommendations made for the old copy count are stale
        return Decision(want, "up" if want > copies else "down", reason, ratios)


def _recommend(copies: int, ratios: dict[str, float]) -> tuple[str, int]:
    """The copies the concurrency asks for, or more when an SLO guard is broken; and which signal decided."""
    load = ratios["concurrency"]
    reason, want = "concurrency", copies if abs(load - 1) <= TOLERANCE else math.ceil(copies * load - 1e-9)
    for name, r in ratios.items():
        need = math.ceil(copies * r - 1e-9)
        if name != "concurrency" and r > 1 + TOLERANCE and need > want:
            reason, want = name, need
    return reason, want
