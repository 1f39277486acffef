"""A routing pipeline: the policy's filters narrow the candidates, its scorers price them, its picker chooses.

Before a pipeline sees a request, the gateway's admission stage (:mod:`.admission`) has let it through and the
request path's own filters (:mod:`.filters`: the model's copies, role, health and breaker, untried) have left
the workers it may go to. A stage that needs something the request lacks (a session key, a tokenized prompt)
makes the whole pipeline fall back to the least loaded worker (reason ``fallback``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fleetllm.router.pipeline.pickers import Picker, least_loaded
from fleetllm.router.pipeline.request import Decision, RouteRequest
from fleetllm.router.pipeline.scorers import Candidates, Scorer

if TYPE_CHECKING:
    from fleetllm.router.pipeline.filters import Filter
    from fleetllm.router.upstream import WorkerState


class Pipeline:
    """``filters`` → ``scorers`` → ``picker``, named ``name`` (the decision counter's ``policy`` label)."""

    def __init__(self, name: str, picker: Picker, filters: Sequence[Filter] = (), scorers: Sequence[Scorer] = (),
                 requires: Callable[[RouteRequest], bool] | None = None, seed: int | None = None) -> None:
        self.name = name
        self.picker = picker
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.requires = requires  # what the request must carry, else the least loaded worker
        self.rng = random.Random(seed)  # ties, for every stage: one seed makes the whole choice repeatable

    def choose(self, req: RouteRequest, workers: list[WorkerState]) -> Decision:
        """Pick one of ``workers`` (non-empty, all routable)."""
        if self.requires is not None and not self.requires(req):
            return Decision(least_loaded(workers, self.rng, req), "fallback")
        narrowed = workers
        for f in self.filters:
            narrowed = f.apply(req, narrowed)
        if not self.scorers:
            return self.picker.pick(Candidates(req, workers, narrowed), self.rng)
        c = Candidates.to_score(req, workers, narrowed)
        for s in self.scorers:
            s.score(c)
        return self.picker.pick(c, self.rng)

    def stages(self) -> dict[str, object]:
        """The stages by kind and name, as ``/router/state`` shows them."""
        return {"filters": [f.name for f in self.filters],
                "scorers": {s.name: s.weight for s in self.scorers}, "picker": self.picker.name}
