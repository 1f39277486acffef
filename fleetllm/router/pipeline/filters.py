"""Filters: which workers may take a request at all, each a small stage with a name.

The request path applies them in this order: the model's copies (the gateway's group, aliases resolved),
:class:`Role` (prefill-only workers are the P/D stage's, not the picker's), then per attempt :class:`Routable`
(healthy, not draining, breaker closed) and :class:`Untried` (a retry never lands where an attempt failed);
then a policy's own, such as :class:`BoundedLoad`. A filter never empties a non-empty list where that would
leave a request nowhere to go when some worker could serve it (:class:`BoundedLoad` keeps all then).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fleetllm.router.index import PrefixIndex
    from fleetllm.router.pipeline.request import RouteRequest
    from fleetllm.router.upstream import WorkerState


class Filter(Protocol):
    name: str

    def apply(self, req: RouteRequest | None, workers: list[WorkerState]) -> list[WorkerState]:
        """The workers of ``workers`` that may take ``req`` (None: before the request is parsed for routing)."""
        ...


class ServesModel:
    """The copies of one served model (``None``: a fleet that names no model, any worker); a worker that has
    not said which model it serves takes only a one-model fleet's requests."""

    name = "model"

    def __init__(self, model: str | None, one_model: bool) -> None:
        self.model, self.one_model = model, one_model

    def apply(self, req: RouteRequest | None, workers: list[WorkerState]) -> list[WorkerState]:
        if self.model is None:
            return workers
        return [w for w in workers if w.model == self.model or (w.model is None and self.one_model)]


class Role:
    """Workers that decode (``decode`` or ``both``); prefill-only workers serve the P/D stage."""

    name = "role"

    def apply(self, req: RouteRequest | None, workers: list[WorkerState]) -> list[WorkerState]:
        return [w for w in workers if w.role != "prefill"]


class Routable:
    """Healthy, not draining, and its circuit breaker lets a request through at ``now``."""

    name = "health"

    def __init__(self, now: float) -> None:
        self.now = now

    def apply(self, req: RouteRequest | None, workers: list[WorkerState]) -> list[WorkerState]:
        return [w for w in workers if w.routable(self.now)]


class Untried:
    """Not one of the workers an earlier attempt of this request failed on."""

    name = "untried"

    def __init__(self, tried: Collection[str]) -> None:
        self.tried = tried

    def apply(self, req: RouteRequest | None, workers: list[WorkerState]) -> list[WorkerState]:
        return [w for w in workers if w.name not in self.tried] if self.tried else workers


def load_bound(workers: list[WorkerState], c: float) -> int:
    """Bounded load (Mirrokni et al.): the most requests in flight a worker may have after taking one more,
    ``c`` times the mean counting the new one. The least loaded worker is always within it."""
    return math.ceil(c * (sum(w.inflight for w in workers) + 1) / len(workers))


# A session's request whose worker holds at least this share of its prompt's blocks (pool or KV tier) stays there
# past the load bound: its own history, which another worker would recompute whole
SESSION_HOLDER_SHARE = 0.5


class BoundedLoad:
    """Workers within :func:`load_bound`: a hot prefix or session spills instead of piling onto one worker. Past
    the bound stay a request's LoRA adapter's holders (sending it elsewhere costs a load there and evicts another
    adapter, whose requests then miss in turn) and, with a prefix ``index``, the workers holding most of a session's
    prompt (:data:`SESSION_HOLDER_SHARE`, in the pool or a KV tier: an agent's returning turn, whose history
    another worker would compute again, several times the turn's own work, when its sessions return in a burst);
    the cost model weighs their queue against it."""

    name = "bounded_load"

    def __init__(self, c: float = 1.25, index: PrefixIndex | None = None) -> None:
        self.c, self.index = c, index

    def apply(self, req: RouteRequest | None, workers: list[WorkerState]) -> list[WorkerState]:
        bound = load_bound(workers, self.c)
        lora = req.lora_name if req is not None else None
        over = {w.name for w in workers if w.inflight + 1 > bound and lora not in w.resident_adapters}
        keep = self._session_holders(req, workers) if over and req is not None else set()
        return [w for w in workers if w.name not in over or w.name in keep] or workers

    def _session_holders(self, req: RouteRequest, workers: list[WorkerState]) -> set[str]:
        """The workers holding :data:`SESSION_HOLDER_SHARE` of ``req``'s prompt blocks, when it has a session."""
        from fleetllm.router.pipeline.scorers import leading_media

        blocks = req.num_prompt_tokens // max(1, req.block_size)
        if self.index is None or req.session_key is None or blocks == 0:
            return set()
        media = leading_media(self.index, req, workers)
        return {name for name, m in media.items() if len(m) >= SESSION_HOLDER_SHARE * blocks}
