"""Fixtures for the reliability tests: one simulated worker and a router over it, shared by the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fleet_helpers import ThreadServers, procs, router, sim_workers, wait_state  # noqa: F401  (procs: fixture)


@pytest.fixture(scope="session")
def sim() -> Iterator[ThreadServers]:
    """One simulated worker (real scheduler and cache, timing model) served in-process."""
    s = sim_workers(1, "--sim-speed", "4")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def sim_router(sim: ThreadServers) -> Iterator[ThreadServers]:
    """A router over ``sim``, once it knows the worker's model."""
    r = router(sim.urls, "kv_aware")
    wait_state(r.url, lambda s: all(w["healthy"] and w["model"] for w in s["workers"]))
    yield r
    r.stop()
