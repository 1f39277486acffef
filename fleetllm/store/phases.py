"""Cold-start phases of a model: resolve, download, verify (the store's), load and warm-up (the engine's).

The same names are the ``phase`` label of ``fleetllm_worker_cold_start_seconds`` and the lines of
``fleetllm models pull``; a phase that did not happen (a cached model downloads nothing) is 0.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

STORE_PHASES = ("resolve", "download", "verify")
PHASES = (*STORE_PHASES, "load", "warm_up")


class Phases:
    """Seconds per phase; a phase timed twice (verify before and after a re-fetch) adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(STORE_PHASES, 0.0)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


def format_phases(seconds: dict[str, float]) -> str:
    """``resolve 0.02s  download 10.8s  verify 0.4s ...`` in the order of :data:`PHASES`."""
    return "  ".join(f"{p} {seconds[p]:.2f}s" for p in PHASES if p in seconds)
