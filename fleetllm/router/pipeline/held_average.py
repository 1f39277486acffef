"""Each tenant's batch slots held, averaged over time: whether a tenant is *bulk* work (a flood) is judged on what
it holds over the last few seconds, not at one instant, so a tenant well under its share whose requests happen to
arrive together (a Poisson burst) is not taken for a flood and held back, while one holding its share or more for
seconds is."""

from __future__ import annotations

import math


class HeldAverage:
    """Per tenant, an exponentially weighted time average of a count (its requests let through and not ended)
    over ``window_s`` seconds; with ``window_s`` 0, the count itself."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._avg: dict[str, tuple[float, float, int]] = {}  # tenant: (average, when, the count since then)

    def note(self, tenant: str, count: int, now: float) -> float:
        """Record that ``tenant`` holds ``count`` from ``now`` on; return its average up to ``now``."""
        avg, then, held = self._avg.get(tenant, (0.0, now, 0))
        if self.window_s > 0:
            avg = held + (avg - held) * math.exp(-max(0.0, now - then) / self.window_s)
        else:
            avg = float(count)
        self._avg[tenant] = (avg, now, count)
        return avg

    def forget(self, tenant: str) -> None:
        """Drop ``tenant``'s average (it holds and waits for nothing: it starts again from zero)."""
        self._avg.pop(tenant, None)
