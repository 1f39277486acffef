"""The router's routing policies, each a :class:`~fleetllm.router.pipeline.pipeline.Pipeline` by name.

================  =================  ==========================================  ==============
policy            filters            scorers                                     picker
================  =================  ==========================================  ==============
``round_robin``                                                                  round_robin
``least_load``                                                                   least_load
``session``                                                                      session (ring)
``prefix``        bounded_load       queue, prefix, decode, kv_pressure, lora    lowest_cost
``kv_aware``      bounded_load       queue, prefix, decode, kv_pressure, lora    lowest_cost
================  =================  ==========================================  ==============

``prefix`` reads an index of what the router itself routed (TTL'd); ``kv_aware`` the same stages over an index
kept exact by the workers' KV events (see :mod:`fleetllm.router.index`). Their cost (in estimated seconds,
:mod:`fleetllm.router.pipeline.cost`) weighs a holder's queue against the prefix it saves, so a new session of a
hot prefix spills to another worker (which then computes and caches the prefix: a second replica) as soon as
waiting at the holders costs more than recomputing. ``--scorer-weight NAME=W`` reweights their scorers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from fleetllm.errors import UsageError
from fleetllm.router.index import PrefixIndex
from fleetllm.router.pipeline.cost import CostModel
from fleetllm.router.pipeline.filters import BoundedLoad
from fleetllm.router.pipeline.pickers import (
    LeastLoadPicker,
    LowestCostPicker,
    RoundRobinPicker,
    SessionRingPicker,
)
from fleetllm.router.pipeline.pipeline import Pipeline
from fleetllm.router.pipeline.request import Decision, RouteRequest
from fleetllm.router.pipeline.scorers import (
    DecodeScorer,
    KVPressureScorer,
    LoraScorer,
    PrefixScorer,
    QueueScorer,
)

if TYPE_CHECKING:  # httpx, which upstream imports, is no part of a worker's start (the CLI imports this module)
    from fleetllm.router.upstream import WorkerState

__all__ = ["POLICY_NAMES", "SCORER_NAMES", "CostModel", "Decision", "LeastLoad", "Policy", "PrefixAware",
           "RoundRobin", "RouteRequest", "Session", "make_policy", "scorer_weights"]


class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, workers: list[WorkerState]) -> Decision:
        """Pick one of ``workers`` (non-empty, all routable)."""
        ...


class RoundRobin(Pipeline):
    def __init__(self) -> None:
        super().__init__("round_robin", RoundRobinPicker())


class LeastLoad(Pipeline):
    """Fewest requests in flight (counted at dispatch), then fewest queued prefill tokens."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__("least_load", LeastLoadPicker(), seed=seed)


class Session(Pipeline):
    """Consistent hashing of the session key with bounded load; least load without a key."""

    def __init__(self, c: float = 1.25, vnodes: int = 64, seed: int | None = None) -> None:
        ring = SessionRingPicker(c, vnodes)
        super().__init__("session", ring, requires=ring.usable, seed=seed)


SCORER_NAMES = ("queue", "prefix", "decode", "kv_pressure", "lora")


class PrefixAware(Pipeline):
    """Cheapest worker by the cost model's scorers, counting as cached the prefix the index says it holds,
    among the workers within bounded load (``balance`` times the mean in flight)."""

    def __init__(self, name: str, index: PrefixIndex, cost: CostModel | None = None, seed: int | None = None,
                 balance: float = 1.25, weights: Mapping[str, float] | None = None) -> None:
        cost = cost or CostModel()
        w = {n: 1.0 for n in SCORER_NAMES} | dict(weights or {})
        self.index, self.cost = index, cost
        super().__init__(name, LowestCostPicker(), filters=[BoundedLoad(balance, index)],
                         scorers=[QueueScorer(cost, w["queue"]), PrefixScorer(index, cost, w["prefix"]),
                                  DecodeScorer(cost, w["decode"]), KVPressureScorer(cost, w["kv_pressure"]),
                                  LoraScorer(cost, w["lora"])],
                         requires=_scorable, seed=seed)


def _scorable(req: RouteRequest) -> bool:
    """A tokenized prompt, or an adapter to place by (else least load)."""
    return req.tokenized or req.lora_name is not None


POLICY_NAMES = ("round_robin", "least_load", "session", "prefix", "kv_aware")


def make_policy(name: str, index: PrefixIndex, cost: CostModel | None = None, seed: int | None = None,
                weights: Mapping[str, float] | None = None) -> Pipeline:
    """The policy called ``name`` (one of ``POLICY_NAMES``); ``weights`` reweight the cost scorers."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad(seed)
    if name == "session":
        return Session(seed=seed)
    if name in ("prefix", "kv_aware"):
        return PrefixAware(name, index, cost, seed, weights=weights)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def scorer_weights(given: Mapping[str, str]) -> dict[str, float]:
    """``--scorer-weight NAME=W`` as weights: a known scorer and a finite number ≥ 0, else one UsageError."""
    out: dict[str, float] = {}
    for name, text in given.items():
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if name not in SCORER_NAMES or not 0.0 <= value < float("inf"):
            raise UsageError(f"--scorer-weight {name}={text}: a scorer ({', '.join(SCORER_NAMES)}) and a weight "
                             ">= 0")
        out[name] = value
    return out
