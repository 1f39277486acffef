"""Pickers: the last stage, which chooses one of the candidates and says why.

Reasons (the ``reason`` label of the decision counter):

- ``affinity``  the worker that already holds the most of this request's prefix (or its session)
- ``spill``     another worker was chosen although one held more of the prefix / owned the session,
                because the affine one was too loaded
- ``cold``      no worker holds any of the prefix: chosen by cost (load) alone
- ``balance``   a load-only choice (round_robin, least_load)
- ``fallback``  the pipeline lacked what it needs (no session key, no tokens): least load instead
- ``retry``     a second or later attempt after a failure before the first byte (set by the forwarder)
"""

from __future__ import annotations

import bisect
import hashlib
import random
from typing import TYPE_CHECKING, Protocol

from fleetllm.router.pipeline.admission import displaceable
from fleetllm.router.pipeline.filters import load_bound
from fleetllm.router.pipeline.request import Decision

if TYPE_CHECKING:
    from fleetllm.router.pipeline.request import RouteRequest
    from fleetllm.router.pipeline.scorers import Candidates
    from fleetllm.router.upstream import WorkerState


class Picker(Protocol):
    name: str

    def pick(self, c: Candidates, rng: random.Random) -> Decision:
        """One of ``c.workers`` (non-empty), ties broken with ``rng``."""
        ...


def least_loaded(workers: list[WorkerState], rng: random.Random, req: RouteRequest | None = None) -> WorkerState:
    """Fewest requests in flight that ``req`` would wait behind (counted at dispatch), then fewest in flight, then
    fewest pending prefill tokens; ties at random.

    An ``urgent`` request does not wait behind this router's bulk requests at a worker that gives it their batch
    slots (:func:`~fleetllm.router.pipeline.admission.displaceable`): counting them sent a burst of interactive
    requests beside a batch job to the worker with fewer batch lines but more interactive streams, where the
    ninth found every slot held by its peers (TTFT 300 ms against a p50 of 37)."""

    def load(w: WorkerState) -> tuple[int, int, int]:
        ahead = w.inflight - (displaceable(w) if req is not None and req.urgent else 0)
        return ahead, w.inflight, w.pending_prefill_tokens

    best = min(load(w) for w in workers)
    return rng.choice([w for w in workers if load(w) == best])


class RoundRobinPicker:
    """Each worker in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, c: Candidates, rng: random.Random) -> Decision:
        w = c.workers[self._next % len(c.workers)]
        self._next += 1
        return Decision(w, "balance")


class LeastLoadPicker:
    """:func:`least_loaded`."""

    name = "least_load"

    def pick(self, c: Candidates, rng: random.Random) -> Decision:
        return Decision(least_loaded(c.workers, rng, c.req), "balance")


class LowestCostPicker:
    """The lowest total of the scorers' costs, ties at random; the reason compares the chosen worker's prefix
    depth with the deepest any candidate holds."""

    name = "lowest_cost"

    def pick(self, c: Candidates, rng: random.Random) -> Decision:
        low = min(c.cost)
        ties = [i for i, cost in enumerate(c.cost) if cost <= low + 1e-9]
        i = rng.choice(ties)
        w = c.workers[i]
        depth = c.depth or {}
        best = max(depth.values(), default=0)
        reason = "cold" if best == 0 else "affinity" if depth[w.name] == best else "spill"
        return Decision(w, reason, c.cached[i])


class SessionRingPicker:
    """Consistent hashing of the session key with bounded load (Mirrokni et al.): walk the ring from
    the key's point to the first worker within :func:`~fleetllm.router.pipeline.filters.load_bound`.
    Adding or removing a worker moves only the sessions that hashed to it."""

    name = "session"

    def __init__(self, c: float = 1.25, vnodes: int = 64) -> None:
        self.c = c
        self.vnodes = vnodes
        self._ring: list[tuple[int, str]] = []
        self._ring_names: frozenset[str] = frozenset()

    @staticmethod
    def _point(s: str) -> int:
        return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")

    def _build(self, names: frozenset[str]) -> None:
        self._ring = sorted((self._point(f"{n}#{i}"), n) for n in names for i in range(self.vnodes))
        self._ring_names = names

    @staticmethod
    def usable(req: RouteRequest) -> bool:
        return req.session_key is not None

    def pick(self, c: Candidates, rng: random.Random) -> Decision:
        assert c.req.session_key is not None
        by_name = {w.name: w for w in c.workers}
        names = frozenset(by_name)
        if names != self._ring_names:
            self._build(names)
        bound = load_bound(c.workers, self.c)
        start = bisect.bisect(self._ring, (self._point(c.req.session_key), ""))
        owner = None
        for k in range(len(self._ring)):
            w = by_name[self._ring[(start + k) % len(self._ring)][1]]
            if owner is None:
                owner = w
            if w.inflight + 1 <= bound:
                return Decision(w, "affinity" if w is owner else "spill")
        assert owner is not None
        return Decision(owner, "affinity")  # unreachable: the least loaded worker is always within bound
