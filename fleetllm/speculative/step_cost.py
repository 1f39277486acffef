"""What a decode step of the target costs, measured once at start-up: the input of adaptive K.

A step's time is modelled as ``rows(n) + per_verify * v`` for ``n`` token rows of which ``v`` sequences
verify drafts. ``rows`` is piecewise linear over measured row counts; the counts include both sides of
every kernel bound in the model (a quantised linear switching kernels at a row count, :class:`ByWidth`), so
the jump there is measured, not interpolated across. ``per_verify`` is what a verifying sequence adds
over the same rows decoded one per sequence (its chunk attention call per layer, its inputs).

What a sequence's context adds is measured too, since at long contexts attention is most of a step and its cost
depends on how the verify chunk's queries read the cache (one pass per query through the paged kernel, or one
per tile of queries): one sequence at ``CONTEXT`` tokens with 0, 1, 2, ... drafts, less what the row model gives
the same rows at a short context (:meth:`StepCost.context_seconds`, taken as growing linearly with the context).

Measured through :meth:`ModelRunner.execute` itself, on scratch sequences over the first blocks of the KV
pool (two, or a long context's; nothing is cached before the first request): every row's logits, as a verify step computes
them. On a shared machine one step can take twice its time, so every size up to ``WIDE`` rows is timed
``REPEATS`` times in interleaved rounds (a slow spell stretches every size alike, not one) and the fastest is
kept: noise only ever adds time. Wider steps are timed once: they are most of the measure's time (it runs at
every start of a worker), and a step timed too slow only makes adaptive K draft less in wide batches.
"""

from __future__ import annotations

import bisect
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fleetllm.engine.params import SamplingParams
from fleetllm.engine.scheduler import Scheduled
from fleetllm.engine.sequence import Sequence
from fleetllm.models.quant import ByWidth

if TYPE_CHECKING:
    from fleetllm.engine.model_runner import ModelRunner

POWERS = (1, 2, 4, 8, 16, 32, 64)  # wider steps: scaled from the widest (a start-up cost, paid by every worker)
SHORT = 15  # tokens of context of the row measures: the step's tokens stay within the first two blocks
REPEATS = 2
WIDE = 32  # steps of more rows are timed once: most of the measure's time, and noise there only makes K smaller
VERIFY_ROWS = 16  # the per-verify overhead is measured on this many rows, verified two by two
CONTEXT = 2048  # tokens of context the context's share is measured at (fewer if the KV cache is smaller)
CONTEXT_DRAFTS = (0, 2, 3, 8)  # drafts it is measured with (between: interpolated)


@dataclass
class StepCost:
    """Seconds of a step of ``n`` rows, ``v`` of its sequences verifying drafts: ``cost(n, v)``."""

    sizes: list[int]  # row counts measured, ascending
    times: list[float]  # seconds of a decode step of that many rows (one row per sequence)
    per_verify: float = 0.0  # seconds a verifying sequence adds
    context: int = 0  # tokens of context ``context_extra`` was measured at (0: not measured)
    context_extra: list[float] | None = None  # [k]: seconds ``context`` tokens add to a sequence verifying k drafts

    def __call__(self, n: int, verifying: int = 0) -> float:
        return self.rows(n) + self.per_verify * verifying

    def rows(self, n: int) -> float:
        """Time of ``n`` rows: linear between measured counts, proportional beyond the last."""
        sizes, times = self.sizes, self.times
        i = bisect.bisect_left(sizes, n)
        if i == 0:
            return times[0]
        if i == len(sizes):
            return times[-1] * n / sizes[-1]
        f = (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return times[i - 1] + f * (times[i] - times[i - 1])

    def context_seconds(self, drafts: int, n_ctx: int) -> float:
        """Seconds a sequence with ``n_ctx`` tokens of context adds to the step when it verifies ``drafts``
        drafts (0: a plain decode row), beyond the same rows at a short context."""
        extra = self.context_extra
        if not extra or n_ctx <= SHORT:
            return 0.0
        k = min(drafts, len(extra) - 1)
        return extra[k] * (n_ctx - SHORT) / (self.context - SHORT)

    @classmethod
    def measure(cls, runner: ModelRunner, max_rows: int = 128) -> StepCost:
        """Time the target's steps on ``runner`` (once per model and thread count in a process)."""
        mine = _MEASURED.setdefault(runner.model, {})
        key = (torch.get_num_threads(), max_rows)
        if key not in mine:
            mine[key] = _measure_or_cached(runner, max_rows)
        return mine[key]


# per model (weakly: engines over other weights measure their own), then per (threads, max_rows)
_MEASURED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, int], StepCost]] = weakref.WeakKeyDictionary()


def _measure_or_cached(runner: ModelRunner, max_rows: int) -> StepCost:
    """The measure of this machine, model shape and code kept on disk (``step_cost_cache``), else a new one."""
    from fleetllm.kernels.health import statuses
    from fleetllm.speculative import step_cost_cache

    statuses(wait=True)  # the steps served are the kernels' (a measure of the eager fallback is wrong, and keyed apart)
    name = step_cost_cache.key(runner, max_rows)
    if (cost := step_cost_cache.load(name)) is None:
        cost = _measure(runner, row_sizes(runner.model, max_rows))
        step_cost_cache.save(name, cost)
    return cost


def row_sizes(model: torch.nn.Module, max_rows: int) -> list[int]:
    """Row counts to measure: powers of two up to ``max_rows`` and both sides of every kernel bound below it."""
    bounds = {m.rows for m in model.modules() if isinstance(m, ByWidth)}
    sizes = {n for n in POWERS if n <= max_rows} | {n for b in bounds for n in (b - 1, b) if 1 <= n <= max_rows}
    return sorted(sizes)


def _measure(runner: ModelRunner, sizes: list[int]) -> StepCost:
    best = {n: float("inf") for n in sizes}
    pairs = min(VERIFY_ROWS, sizes[-1]) // 2
    best_verify = float("inf")
    for r in range(REPEATS):
        for n in sizes if r == 0 else [n for n in sizes if n <= WIDE]:
            best[n] = min(best[n], _time_step(runner, n, 0))
        if pairs:
            best_verify = min(best_verify, _time_step(runner, pairs, 1))
    times = [best[n] for n in sizes]
    context = context_for(runner)
    for i in range(1, len(times)):  # more rows never cost less: what is left of the noise
        times[i] = max(times[i], times[i - 1])
    cost = StepCost(sizes, times)
    if pairs:
        cost.per_verify = max(0.0, (best_verify - cost.rows(2 * pairs)) / pairs)
    if context > 4 * SHORT:
        cost.context, cost.context_extra = context, _context_extra(runner, cost, context)
    return cost


def context_for(runner: ModelRunner) -> int:
    """Tokens of context the context's share is measured at on ``runner``: ``CONTEXT``, or the largest power of two
    its pool and model hold. A power of two, so that pools of many sizes share one measure on disk
    (``step_cost_cache`` keys by it): the share is scaled linearly to other lengths anyway."""
    slots = runner.kv_cache[0][0].shape[0]  # the pool: num_blocks * block_size
    most = min(slots - runner.block_size, runner.model.cfg.max_position_embeddings) - max(CONTEXT_DRAFTS) - 1
    return min(CONTEXT, 1 << (most.bit_length() - 1)) if most > 0 else most


def _context_extra(runner: ModelRunner, cost: StepCost, context: int) -> list[float]:
    """Seconds ``context`` tokens add to one sequence's step by drafts 0 .. max(CONTEXT_DRAFTS): measured at
    ``CONTEXT_DRAFTS`` (the fastest of ``REPEATS - 1`` interleaved rounds) less what ``cost`` gives the same rows
    at a short context, interpolated between."""
    long_ = dict.fromkeys(CONTEXT_DRAFTS, float("inf"))
    for _ in range(REPEATS - 1):
        for k in CONTEXT_DRAFTS:
            long_[k] = min(long_[k], _time_step(runner, 1, k, context))
    measured = [(k, max(0.0, long_[k] - cost(1 + k, int(k > 0)))) for k in CONTEXT_DRAFTS]
    out = []
    for k in range(max(CONTEXT_DRAFTS) + 1):
        (k0, e0), (k1, e1) = next((a, b) for a, b in zip(measured, measured[1:], strict=False) if b[0] >= k)
        out.append(e0 + (e1 - e0) * (k - k0) / (k1 - k0))
    return out


@torch.inference_mode()
def _time_step(runner: ModelRunner, seqs: int, drafts: int, context: int = 0) -> float:
    """Seconds of one step of ``seqs`` scratch sequences, each computing its next token and ``drafts`` drafts
    after ``context`` tokens (default: within the first two blocks)."""
    bs = runner.block_size
    prompt = [0] * (context or SHORT)
    table = list(range(1 + (len(prompt) + drafts) // bs))
    batch = []
    for i in range(seqs):
        seq = Sequence(f"step-cost-{i}", prompt, SamplingParams(), max_tokens=1, block_table=table)
        seq.num_computed_tokens = len(prompt) - 1
        batch.append(Scheduled(seq, 1 + drafts, [0] * drafts))
    rows = list(range(seqs * (1 + drafts)))
    t0 = time.perf_counter()
    logits, _ = runner.execute(batch, rows)
    if logits.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0
