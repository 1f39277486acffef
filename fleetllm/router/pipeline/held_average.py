"""Counts averaged over time.

:class:`TimeAverage` is one count's exponentially weighted time average. :class:`HeldAverage` keeps one per
tenant: whether a tenant is *bulk* work (a flood) is judged on what it holds over the last few seconds, not at
one instant, so a tenant well under its share whose requests happen to arrive together (a Poisson burst) is not
taken for a flood and held back, while one holding its share or more for seconds is. The routing cost reads a
worker's streams the same way (:meth:`~fleetllm.router.pipeline.cost.CostModel.decode_s`): an agent session
between two turns holds no request, yet its next turn comes back to the worker holding its context."""

from __future__ import annotations

import math


class TimeAverage:
    """A count's exponentially weighted average over time, with a window of ``window_s`` seconds (0: the count
    itself). The count is a step function: :meth:`note` each change, :meth:`at` any time after."""

    __slots__ = ("_avg", "_held", "_then")

    def __init__(self) -> None:
        self._avg, self._then, self._held = 0.0, None, 0.0

    def at(self, now: float, window_s: float) -> float:
        """The average up to ``now`` (0 before the first note)."""
        if self._then is None:
            return 0.0
        if window_s <= 0:
            return self._held
        return self._held + (self._avg - self._held) * math.exp(-max(0.0, now - self._then) / window_s)

    def note(self, count: float, now: float, window_s: float) -> float:
        """Record that the count is ``count`` from ``now`` on; return the average up to ``now``."""
        avg = self.at(now, window_s) if self._then is not None else 0.0
        if window_s <= 0:
            avg = float(count)
        self._avg, self._then, self._held = avg, now, float(count)
        return avg


class HeldAverage:
    """Per tenant, a :class:`TimeAverage` of a count (its requests let through and not ended) over ``window_s``
    seconds; with ``window_s`` 0, the count itself."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._avg: dict[str, TimeAverage] = {}

    def note(self, tenant: str, count: int, now: float) -> float:
        """Record that ``tenant`` holds ``count`` from ``now`` on; return its average up to ``now``."""
        return self._avg.setdefault(tenant, TimeAverage()).note(count, now, self.window_s)

    def forget(self, tenant: str) -> None:
        """Drop ``tenant``'s average (it holds and waits for nothing: it starts again from zero)."""
        self._avg.pop(tenant, None)
