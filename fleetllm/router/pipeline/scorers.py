"""Scorers: each adds its part of a candidate's cost, in seconds (lower is better), times its weight.

The parts of :class:`~fleetllm.router.pipeline.cost.CostModel`, one scorer each: ``queue`` (the work
queued ahead), ``prefix`` (prefilling what the worker does not hold: the prefix affinity), ``decode`` (its
streams, over the request's expected output), ``kv_pressure`` (a nearly full pool) and ``lora`` (loading the request's adapter where it is
not resident: the adapter affinity). The ``prefix`` scorer also records, for the
picker's reason, how many leading blocks each worker holds (:attr:`Candidates.depth`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fleetllm.router.pipeline.cost import CostModel

if TYPE_CHECKING:
    from collections.abc import Callable

    from fleetllm.router.index import PrefixIndex
    from fleetllm.router.pipeline.request import RouteRequest
    from fleetllm.router.upstream import WorkerState


@dataclass
class Candidates:
    """The workers one request may go to, as the stages narrow and score them.

    ``everyone`` is the list before the policy's own filters (what the reason compares against);
    ``workers`` after them, ``cost[i]`` and ``cached[i]`` being ``workers[i]``'s (empty when nothing scores)."""

    req: RouteRequest
    everyone: list[WorkerState]
    workers: list[WorkerState]
    cost: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # prompt tokens ``workers[i]`` holds (its pool or tiers)
    depth: dict[str, int] | None = None  # leading blocks each of ``everyone`` holds; None: nobody looked

    @classmethod
    def to_score(cls, req: RouteRequest, everyone: list[WorkerState], workers: list[WorkerState]) -> Candidates:
        """Candidates whose costs and cached counts start at zero, for scorers to add to."""
        return cls(req, everyone, workers, [0.0] * len(workers), [0] * len(workers))


class Scorer(Protocol):
    name: str
    weight: float

    def score(self, c: Candidates) -> None:
        """Add this scorer's part (times its weight) to every ``c.cost[i]``."""
        ...


class WorkerTermScorer:
    """A cost term of each worker alone (and the request), times the scorer's weight: subclasses give ``term``."""

    name = ""

    def __init__(self, cost: CostModel, weight: float = 1.0) -> None:
        self.model, self.weight = cost, weight

    def term(self, w: WorkerState, req: RouteRequest) -> float:
        raise NotImplementedError

    def score(self, c: Candidates) -> None:
        for i, w in enumerate(c.workers):
            c.cost[i] += self.weight * self.term(w, c.req)


class QueueScorer(WorkerTermScorer):
    """The work queued ahead on the worker (:meth:`CostModel.queue_s`)."""

    name = "queue"

    def term(self, w: WorkerState, req: RouteRequest) -> float:
        return self.model.queue_s(w)


class PrefixScorer:
    """Prefill of the tokens the worker does not hold, by the prefix index (the pool's blocks are free, a
    tier's cost their load time, :meth:`CostModel.tier_block_s`): the prefix-affinity part."""

    name = "prefix"

    def __init__(self, index: PrefixIndex, cost: CostModel, weight: float = 1.0) -> None:
        self.index, self.model, self.weight = index, cost, weight

    def score(self, c: Candidates) -> None:
        req, fraction = c.req, self.model.load_fraction
        media = leading_media(self.index, req, c.everyone, fraction)  # per worker: pool or a tier, each block
        c.depth = {name: len(m) for name, m in media.items()}
        for i, w in enumerate(c.workers):
            bs = w.block_size or req.block_size
            cached = min(c.depth[w.name] * bs, max(req.num_prompt_tokens - 1, 0))
            loaded_s = sum(self.model.tier_block_s(w, m, bs) for m in media[w.name])  # tier blocks: a load each
            c.cached[i] = cached
            c.cost[i] += self.weight * (self.model.prefill_s(req.num_prompt_tokens - cached) + loaded_s)


def leading_media(index: PrefixIndex, req: RouteRequest, workers: list[WorkerState],
                  rank: Callable[[str], float] = lambda m: 0.0) -> dict[str, list[str]]:
    """Per worker, where it holds each leading block of ``req``'s prompt (its pool, or the medium of the KV tier
    ranked lowest by ``rank`` of those holding it), up to its first miss: one index lookup per way of hashing
    (fleetllm's, vLLM's) among ``workers``."""
    media: dict[str, list[str]] = {}
    schemes = {w.hash_scheme for w in workers}
    for scheme in schemes:
        same = workers if len(schemes) == 1 else [w for w in workers if w.hash_scheme == scheme]
        media.update(index.match_media(req.hashes_for(same[0]), [w.name for w in same], rank))
    return media


class DecodeScorer:
    """What the worker's streams add to the request's decode, over the tokens it is expected to generate
    (:meth:`CostModel.decode_s`). Runs after ``prefix``: a worker holding at least half of the prompt holds the
    request's own history (a session's previous turn), which its load average is not to count against it."""

    name = "decode"

    def __init__(self, cost: CostModel, weight: float = 1.0) -> None:
        self.model, self.weight = cost, weight

    def score(self, c: Candidates) -> None:
        out, half = c.req.expected_output_tokens, c.req.num_prompt_tokens / 2
        for i, w in enumerate(c.workers):
            own = c.cached[i] if c.cached and c.cached[i] >= half > 0 else 0
            c.cost[i] += self.weight * self.model.decode_s(w, out, own)


class LoraScorer(WorkerTermScorer):
    """Loading the request's LoRA adapter where it is not resident (:meth:`CostModel.adapter_s`): adapter
    affinity."""

    name = "lora"

    def term(self, w: WorkerState, req: RouteRequest) -> float:
        return self.model.adapter_s(w, req.lora_name)


class KVPressureScorer(WorkerTermScorer):
    """A worker whose KV pool is nearly full (:meth:`CostModel.pressure_s`)."""

    name = "kv_pressure"

    def term(self, w: WorkerState, req: RouteRequest) -> float:
        return self.model.pressure_s(w)
