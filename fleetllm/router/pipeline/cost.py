"""The routing cost model: the seconds a worker would take to finish a request, in four parts, each a scorer.

``queue + this request's uncached tokens / prefill_rate + γ · its expected output tokens · what the worker's
streams add to each of its steps + KV-pressure penalty`` (docs/architecture.md, "Routing cost"). The queue is the time before this request's prefill would start: the
prompt tokens queued ahead of it at the prefill rate, plus a step's share for each request queued ahead
(:meth:`CostModel.queue_s`). A prefix block a worker holds in a KV tier rather than its pool (host memory,
disk: its KV events say the medium; or the shared tier every worker of its layout reads, whichever worker
reported the block) costs the load time that worker measured for that tier (its load reports say), or
until it has loaded one, :attr:`CostModel.tier_load` (a fraction of recomputing it). A request naming a LoRA
adapter its worker does not hold resident adds :attr:`CostModel.lora_load_s` (a fifth part, the ``lora`` scorer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fleetllm.errors import UsageError
from fleetllm.router.index import POOL, SHARED, is_pool

if TYPE_CHECKING:
    from fleetllm.router.upstream import WorkerState


@dataclass
class CostModel:
    """Seconds a worker would take to finish this request; calibrated rates come from a profile."""

    prefill_tokens_per_s: float = 1000.0
    decode_tokens_per_s: float = 50.0  # one running stream's share of a step, in steps per second
    # what each context token of a running stream adds to a decode step, in seconds (its KV read)
    decode_context_s: float = 0.0
    gamma: float = 1.0
    # a worker's streams are counted as the larger of now and their time average over this window, so an agent
    # session between turns (no request in flight, its context held there for its next turn) still counts
    load_window_s: float = 3.0
    kv_high: float = 0.8  # above this KV usage a worker is penalised, up to kv_penalty_s at 100%
    kv_penalty_s: float = 2.0
    # Loading a block from a worker's KV tier, as a fraction of recomputing it (by the tier's medium in the
    # workers' KV events). A medium not named here is priced as a miss.
    tier_load: dict[str, float] = field(default_factory=lambda: {"CPU": 0.05, "DISK": 0.15, SHARED: 0.25})
    # A copy that does not hold a request's LoRA adapter resident: the seconds its load costs there, and the
    # adapter it evicts costs that copy's own requests later (fleetllm/router/adapters.py)
    lora_load_s: float = 0.5

    def with_tier_load(self, fractions: dict[str, str]) -> CostModel:
        """This model with ``fractions`` (``--kv-tier-load MEDIUM=FRACTION``) replacing its tiers' prices."""
        load = dict(self.tier_load)
        for medium, text in fractions.items():
            try:
                value = float(text)
            except ValueError:
                value = -1.0
            if not 0.0 <= value <= 1.0 or is_pool(medium):
                raise UsageError(f"--kv-tier-load {medium}={text}: a tier's medium (CPU, DISK, SHARED) and a fraction of "
                                 "recomputing, 0 to 1")
            load[medium.upper()] = value
        return replace(self, tier_load=load)

    def load_fraction(self, medium: str) -> float:
        """What a block held in ``medium`` costs, as a fraction of recomputing it (0 in the pool)."""
        return 0.0 if medium == POOL else min(1.0, self.tier_load.get(medium, 1.0))

    def tier_block_s(self, w: WorkerState, medium: str, block_size: int) -> float:
        """Seconds for ``w`` to bring one block of ``block_size`` tokens from ``medium``: the load time its KV
        events report it measured for that tier, else (no load yet, or a worker that measures none) the tier's
        :attr:`tier_load` fraction of recomputing the block; nothing from its pool."""
        if medium == POOL:
            return 0.0
        measured = w.tier_load_s.get(medium)
        return measured if measured is not None else self.load_fraction(medium) * self.prefill_s(block_size)

    def cost(self, w: WorkerState, uncached: float, lora_name: str | None = None, output_tokens: float = 1.0) -> float:
        """Seconds until ``w`` would have computed a request's ``uncached`` prompt tokens (a fraction of a token
        each for those it would load from a KV tier), with its LoRA adapter ``lora_name`` loaded first if ``w``
        does not hold it, and then its ``output_tokens`` beside ``w``'s streams: the sum of the parts."""
        return (self.queue_s(w) + self.prefill_s(uncached) + self.decode_s(w, output_tokens)
                + self.pressure_s(w) + self.adapter_s(w, lora_name))

    def queue_s(self, w: WorkerState) -> float:
        """Seconds before a request sent to ``w`` now would start its prefill.

        The router's own counts (what it dispatched and has no first byte for) and the worker's report
        (refreshed every event interval, and covering requests other routers sent) describe mostly the same
        requests, so the larger of each is taken rather than their sum. Each queued request also costs a
        step's per-sequence share while it is admitted ahead of this one."""
        tokens = max(w.pending_prefill_tokens, w.queued_prefill_tokens)
        requests = max(pending(w), w.waiting)
        return tokens / self.prefill_tokens_per_s + requests / self.decode_tokens_per_s

    def prefill_s(self, uncached: float) -> float:
        """Seconds to compute ``uncached`` prompt tokens."""
        return uncached / self.prefill_tokens_per_s

    def decode_s(self, w: WorkerState, output_tokens: float = 1.0, own_history: int = 0,
                 now: float | None = None) -> float:
        """What ``w``'s streams add to a new request's decode of ``output_tokens`` tokens: each of its steps
        carries their rows (a step's share each, and their contexts' KV reads), times ``gamma``.

        The streams are the larger of those there now (the router's requests, or the worker's report) and this
        router's requests there averaged over :attr:`load_window_s`; their context tokens likewise (this router's
        own requests'). An agent's session between turns is so still counted where its context is, and a worker
        holding long contexts is priced by them, not by its count of requests. Where ``w`` holds the request's
        own history (``own_history`` of its prompt tokens, its previous turn's), that turn is in the average
        too and is left out of it: a session is not its own neighbour."""
        now = time.monotonic() if now is None else now
        ghost = 1.0 if own_history else 0.0
        streams = max(w.inflight, w.running, w.streams_avg.at(now, self.load_window_s) - ghost)
        context = max(w.inflight_tokens, w.tokens_avg.at(now, self.load_window_s) - own_history)
        return self.gamma * output_tokens * self.step_share_s(streams, context)

    def step_share_s(self, streams: float, context_tokens: float) -> float:
        """What ``streams`` running beside a request, holding ``context_tokens`` of context in all, add to each of
        its decode steps: a row's share each and their KV reads."""
        return streams / self.decode_tokens_per_s + context_tokens * self.decode_context_s

    def adapter_s(self, w: WorkerState, lora_name: str | None) -> float:
        """Loading the request's LoRA adapter on ``w`` first (none: the base model, or one ``w`` holds resident)."""
        return 0.0 if lora_name is None or lora_name in w.resident_adapters else self.lora_load_s

    def pressure_s(self, w: WorkerState) -> float:
        """The penalty of a worker whose KV pool is nearly full (it would preempt or evict)."""
        return self.kv_penalty_s * max(0.0, w.kv_usage - self.kv_high) / (1.0 - self.kv_high)


def pending(w: WorkerState) -> int:
    """Requests the router sent ``w`` that have no first byte yet."""
    return w.inflight - w.decoding
