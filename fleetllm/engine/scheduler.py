"""Token-budget scheduler (vLLM v1 style).

Each step every running sequence asks for the tokens it lacks (one decode token, 1 + K tokens when the
step's input holds K draft tokens for it to verify, or the rest of its prompt as a chunk) within
``max_num_batched_tokens``; waiting sequences are admitted FCFS while budget, sequence slots and blocks
last. Prefill and decode share one step; chunked prefill falls out of the budget (a sequence the KV
connector says runs alone, its KV computed outside this pool, takes a step of its own). When blocks run out
the most recently arrived running sequence is preempted (blocks freed, recomputed later — its prefix
blocks usually survive in the prefix cache).

Under the ``priority`` policy (vLLM's ``--scheduling-policy priority``) both orders follow each request's
rank instead of its arrival alone: waiting sequences are admitted best rank first, running ones are served
best rank first, and the worst-ranked running sequence is the one preempted: under KV pressure, and when every
batch slot is taken and a more urgent waiting sequence ranks before it (it starts at once). The rank ages so
that no request starves: a request's effective priority improves by one level for every ``priority_aging_s``
seconds since it arrived, which orders requests by ``priority * priority_aging_s + arrival_time`` (a
request of priority 5 arriving now ranks like one of priority 0 arriving 5 ageing periods later). A step that
computes the first token of a request of priority <= 0 carries, and admits, at most ``urgent_step_rows`` sequences
of a less urgent priority (0 by default: a first token's step as short as its own priority's rows make it), each
one held back waiting one step at most.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from fleetllm.engine.kv_connector.base import KVConnectorMetadata, KVConnectorScheduler
    from fleetllm.lora.registry import LoraManager


# The batch slots past max_num_seqs that urgent arrivals may take while a step is paused for them, as a fraction of
# max_num_seqs (one at least): an urgent request arriving while an earlier one still decodes in the one extra slot
# waited for the running step (~20 ms of bulk rows on one thread) to displace a bulk row: the fair-serving
# benchmark's B arrives ~3.4 times a second at each worker and decodes ~0.4 s.
URGENT_OVERFLOW = 0.25


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 1024  # bounded queue: beyond this, new requests are refused (HTTP 503)
    watermark: float = 0.01  # fraction of blocks kept free when admitting new work
    policy: Literal["fcfs", "priority"] = "fcfs"  # admission and preemption order
    priority_aging_s: float = 1.0  # under "priority": seconds of waiting worth one priority level (0: no ageing)
    # under "priority": the most rows of a less urgent priority a step carries while it computes the first token of
    # a more urgent request (the best-ranked of them; the others wait that step, never two in a row); None: no limit
    urgent_step_rows: int | None = 0

    def rank(self, seq: Sequence) -> tuple[float, float]:
        """``seq``'s place in the priority order (smaller is served first, preempted last)."""
        if self.priority_aging_s > 0:  # the same for every request at any instant: priority minus age / rate
            return seq.params.priority * self.priority_aging_s + seq.arrival_time, seq.arrival_time
        return float(seq.params.priority), seq.arrival_time


@dataclass
class Scheduled:
    """``num_new_tokens`` tokens of ``seq`` to compute this step; the last ``len(draft_token_ids)`` of
    them are draft tokens to verify (speculative decoding), not yet part of the sequence."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)

    def token_ids(self) -> list[int]:
        c = self.seq.num_computed_tokens
        return self.seq.token_ids_slice(c, c + self.num_new_tokens - len(self.draft_token_ids)) + self.draft_token_ids

    @property
    def num_logits(self) -> int:
        """Rows whose logits are needed: 0 mid-prompt, 1 for a plain step, 1 + K when verifying K drafts."""
        k = len(self.draft_token_ids)
        done = self.seq.num_computed_tokens + self.num_new_tokens - k == self.seq.num_tokens
        return 1 + k if done else 0

    def num_computed(self, emitted: list[int]) -> int:
        """Tokens of this step whose KV stays valid once it emitted ``emitted``: all but rejected drafts
        (verifying K drafts emits the accepted ones and then one target token)."""
        if not self.draft_token_ids:
            return self.num_new_tokens
        return self.num_new_tokens - len(self.draft_token_ids) + len(emitted) - 1


@dataclass
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    displaced: list[Sequence] = field(default_factory=list)  # preempted for a better-ranked waiting sequence's slot
    start_time: float = field(default_factory=time.monotonic)  # when the step began (monotonic seconds)
    kv_connector_metadata: KVConnectorMetadata | None = None  # the KV connector's part of this step (None: none)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # finished with an error at admission

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class UrgentStep:
    """A step computing a first token of ``priority`` (None: no such step, nothing held back): ``room`` rows left
    for less urgent sequences, ``held`` the ids left out of the last step (carried or admitted now whatever
    arrives), ``held_back`` those this step leaves out."""

    priority: int | None
    room: int
    held: set[str]
    held_back: set[str] = field(default_factory=set)

    def holds_back(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits this step (the urgent first token's step stays short); else it takes a row."""
        if self.priority is None or seq.params.priority <= self.priority or seq.request_id in self.held:
            return False
        if self.room <= 0:
            self.held_back.add(seq.request_id)
            return True
        self.room -= 1
        return False


class QueueFull(RuntimeError):
    pass


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager) -> None:
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.connector: KVConnectorScheduler | None = None  # the KV connector's scheduler side, if attached
        self.lora: LoraManager | None = None  # the adapters' slots (set with --enable-lora)
        self._tier_more: set[str] = set()  # request ids whose connector-held tokens did not all find blocks
        self._held_back: set[str] = set()  # request ids left out of the last step for an urgent first token

    def _alone(self, seq: Sequence) -> bool:
        """Whether ``seq``'s step must hold nothing else (the connector computes its KV outside this pool)."""
        return self.connector is not None and self.connector.runs_alone(seq)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.cfg.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        seq.num_held_tokens = self.held_tokens(seq)
        if self.cfg.policy == "priority":
            bisect.insort(self.waiting, seq, key=self.cfg.rank)  # the head is always the best-ranked
        else:
            self.waiting.append(seq)

    def held_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of ``seq`` this worker holds now, in its pool's prefix cache or (after those) a KV
        connector's tiers: work its queue will not compute (a worker's reported load leaves them out, so a
        router does not send a returning session away from the worker keeping its KV). Nothing is read or
        marked recent: an estimate, which evictions before its admission may lower."""
        blocks, _ = self.kv.prefix_hit(seq)
        held = len(blocks) * self.kv.block_size
        if self.connector is not None:
            held += self.connector.num_held_tokens(seq, held)
        return min(held, len(seq.prompt_token_ids))

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, of the waiting and prefilling sequences. A waiting sequence's prefix
        held here when it arrived (:meth:`held_tokens`) is a hit or a load, not work: counted, it would price
        the holder of a returning session as busy and send the session away from its KV. Read from the
        server's thread without locking: a slightly stale view is fine."""
        return sum(max(0, len(s.prompt_token_ids) - max(s.num_computed_tokens, s.num_held_tokens))
                   for s in [*self.waiting, *self.running])

    def has_room(self) -> bool:
        """Whether one more sequence may run now (a sequence slot is free)."""
        return len(self.running) < self.cfg.max_num_seqs

    def add_running(self, seq: Sequence) -> None:
        """Run ``seq`` from the next step on: its prompt is computed already (a handed-over prefill) and it
        holds its blocks; it joins the running sequences as one that has just finished its prefill."""
        seq.transition(Status.RUNNING)
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free when admitting new work (and importing KV blocks)."""
        return int(self.cfg.watermark * self.kv.pool.num_blocks)

    def schedule(self, drafts: Mapping[str, list[int]] | None = None) -> SchedulerOutput:
        """This step's work; ``drafts`` are the draft tokens proposed for running sequences (by request id),
        verified this step when budget and blocks allow."""
        drafts = drafts or {}
        out = SchedulerOutput()
        if self.cfg.policy == "priority":
            self._free_slot_for_better_rank(out)
        budget = self.cfg.max_num_batched_tokens
        kept: list[Sequence] = []
        # served in order, and preempted from the back: FCFS keeps arrival order, priority the best rank first
        queue = sorted(self.running, key=self.cfg.rank) if self.cfg.policy == "priority" else list(self.running)
        urgent = UrgentStep(self._urgent_priority(queue), self.cfg.urgent_step_rows or 0, self._held_back)
        self._held_back = urgent.held_back
        while queue:
            seq = queue.pop(0)
            if urgent.holds_back(seq):
                kept.append(seq)
                continue
            alone = self._alone(seq)
            if budget <= 0 or (alone and out.scheduled):
                kept.append(seq)
                budget = 0 if alone else budget  # nothing after it: it goes once those before it end
                continue
            n = min(seq.num_uncomputed, budget)
            proposed = drafts.get(seq.request_id, [])[: max(0, budget - n)] if n == seq.num_uncomputed else []
            while not self.kv.grow(seq, n + len(proposed)):
                if proposed:  # lookahead slots for drafts are the first thing to give up
                    proposed = []
                    continue
                # preempt the last running sequence not yet scheduled (newest, or worst-ranked); else this one
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                if seq.request_id in self._tier_more:  # tier-held tokens no block took before: loaded, not computed
                    n, proposed = self._load_more(seq, n, budget), []
                kept.append(seq)
                out.scheduled.append(Scheduled(seq, n + len(proposed), list(proposed)))
                budget = 0 if alone else budget - n - len(proposed)
        self.running = kept

        self._admit(out, budget, urgent)
        return out

    def schedule_urgent(self, guard: float) -> SchedulerOutput:
        """A step of its own while the step in flight is paused between layers (:mod:`fleetllm.engine.step_pause`):
        the waiting requests of priority <= 0 more urgent than ``guard`` (the paused step's), best-ranked first,
        admitted within the budget and free blocks without preempting anything (every running row may be in the
        paused step, writing its blocks), into up to :data:`URGENT_OVERFLOW` of ``max_num_seqs`` more batch slots
        (no row gives its slot up mid-step; the batch is back within ``max_num_seqs`` as rows end, since nothing
        is admitted while it is over)."""
        out = SchedulerOutput()

        def eligible(seq: Sequence) -> bool:
            p = seq.params.priority
            return p <= 0 and p < guard and seq.lora_name is None and not self._alone(seq)

        slots = self.cfg.max_num_seqs + max(1, int(self.cfg.max_num_seqs * URGENT_OVERFLOW))
        self._admit(out, self.cfg.max_num_batched_tokens, slots=slots, eligible=eligible)
        return out

    def _urgent_priority(self, running: list[Sequence]) -> int | None:
        """Under ``priority`` with ``urgent_step_rows`` set: the most urgent ``priority`` among the requests whose
        first token this step computes (the waiting head when a batch slot is free for it, running ones whose
        prompt's rest fits the step's budget) of the normal or high band (priority <= 0: someone waits on it; the
        low band is batch and bulk work, whose first tokens hold nothing back); None when there are none.

        A step's time grows with its rows, and a request's first token waits for its whole step: carrying fewer
        less urgent rows in that one step shortens the urgent request's time to first token, while those rows lose
        one step each (their throughput pays a step's fixed cost once more per urgent arrival). A row left out of
        one step is carried in the next whatever arrives, so urgent arrivals at every step slow it to half speed
        at worst, never stop it."""
        if self.cfg.policy != "priority" or self.cfg.urgent_step_rows is None:
            return None
        budget = self.cfg.max_num_batched_tokens
        firsts = [s for s in running if not s.output_token_ids and s.num_uncomputed <= budget]
        if self.waiting and len(running) < self.cfg.max_num_seqs and not self.waiting[0].output_token_ids:
            firsts.append(self.waiting[0])
        return min((s.params.priority for s in firsts if s.params.priority <= 0), default=None)

    def _free_slot_for_better_rank(self, out: SchedulerOutput) -> None:
        """Under ``priority``: every waiting sequence, in order, that finds no free batch slot and ranks before the
        worst-ranked running one takes that one's slot (preempted: recomputed later, its full blocks usually still
        cached). Urgent requests then start at this step instead of when some running ones end, all of a burst at
        once (one slot a step left the second of two urgent arrivals a step behind the first). Only a more urgent
        ``priority`` displaces (a preempted request never displaces its peers that arrived after it), and only
        while its rank is still better (ageing protects a long-running request)."""
        promised = 0  # the slots the waiting sequences before ``head`` take
        for head in list(self.waiting):
            # the batch may be over max_num_seqs (urgent rows admitted while a step was paused): back under it first
            while len(self.running) + promised >= self.cfg.max_num_seqs:
                if head.lora_name is not None or self._alone(head) or not self.running:  # their own admission rules
                    return
                worst = max(self.running, key=self.cfg.rank)
                if head.params.priority >= worst.params.priority or self.cfg.rank(head) >= self.cfg.rank(worst):
                    return
                self.running.remove(worst)
                self._preempt(worst)
                out.displaced.append(worst)
            promised += 1

    def _admit(self, out: SchedulerOutput, budget: int, urgent: UrgentStep | None = None, slots: int | None = None,
               eligible: Callable[[Sequence], bool] | None = None) -> None:
        """Admit waiting sequences in order while budget, sequence slots and blocks last. A sequence whose adapter
        finds no slot (every one pinned by running requests) waits at its place, and only base-model sequences
        pass it until it gets one: the adapters running drain, so it never starves. ``urgent``: a step
        computing an urgent first token (:meth:`_urgent_priority`), which admits less urgent sequences only within
        its rows left; one held back once is admitted at the next. ``slots``: the batch slots (default
        ``max_num_seqs``); ``eligible``: admission stops at the first waiting sequence it refuses."""
        watermark = self.watermark_blocks
        skipped: list[Sequence] = []
        slots = self.cfg.max_num_seqs if slots is None else slots
        while self.waiting and budget > 0 and len(self.running) < slots and not out.preempted:
            seq = self.waiting[0]
            if urgent is not None and urgent.holds_back(seq):  # its first step would lengthen the urgent one's
                break
            if eligible is not None and not eligible(seq):
                break
            if seq.lora_name is not None and (skipped or not self._lora_fits(seq)):
                skipped.append(self.waiting.popleft())
                continue
            alone = self._alone(seq)
            if alone and out.scheduled:
                break
            cached = self.kv.admit(seq, budget, watermark)
            if cached is None:
                break
            self.waiting.popleft()
            if not self._pin_lora(seq, out):
                continue
            n = min(seq.num_uncomputed, budget)  # what admit allocated blocks for, beyond the hit
            n = self._load_external(seq, n, budget) if self.connector is not None else n
            self._count_cached(seq, 0)
            seq.transition(Status.RUNNING)
            self.running.append(seq)
            out.scheduled.append(Scheduled(seq, n))
            budget = 0 if alone else budget - n
        self.waiting.extendleft(reversed(skipped))

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter has or can take a slot now (an unloaded adapter "fits": pinning fails it)."""
        return self.lora is None or not self.lora.has(seq.lora_name) or self.lora.can_acquire(seq.lora_name)

    def _pin_lora(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Pin the just-admitted ``seq``'s adapter slot; False (its blocks freed, it finished with an error in
        ``out.failed``) when the adapter is gone or cannot be read again."""
        if seq.lora_name is None:
            return True
        from fleetllm.lora.errors import LoraError

        try:
            if self.lora is None:
                raise LoraError("adapters are not enabled (--enable-lora)")
            seq.lora_slot = self.lora.acquire(seq.lora_name)
            return True
        except LoraError as e:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.transition(Status.FINISHED_ERROR)
            out.failed.append((seq, e.message))
            return False

    def unpin_lora(self, seq: Sequence) -> None:
        """Let go of ``seq``'s adapter slot (it finished or was preempted)."""
        if seq.lora_slot >= 0 and self.lora is not None:
            self.lora.release(seq.lora_slot)
        seq.lora_slot = -1

    def _load_external(self, seq: Sequence, n: int, budget: int) -> int:
        """Load the tokens of ``seq`` the connector holds beyond its computed ones (counted as computed); return
        the tokens its step computes (``n``, the step's chunk, when none loaded).

        Loaded tokens cost no step budget: blocks are taken for all of them and the step's chunk where free;
        else for as many as the held and free blocks take (above the watermark), the step then computing only
        what its blocks hold, and the rest is asked for again on its next steps (``_tier_more``) rather than
        computed. A connector that cannot load them gives them back (lowers ``num_computed_tokens``): the step
        computes them instead."""
        assert self.connector is not None
        before = seq.num_computed_tokens
        bs = self.kv.block_size
        matched = max(0, min(self.connector.get_num_new_matched_tokens(seq, before), seq.num_tokens - before - 1))
        ext = matched
        if ext and not self.kv.grow(seq, ext + min(seq.num_tokens - before - ext, budget)):
            room = (len(seq.block_table) + max(0, self.kv.pool.num_free - self.watermark_blocks)) * bs - before
            ext = max(0, min(ext, room - 1))  # one token's room kept: the step computes one at least
            if ext:
                self.kv.grow(seq, ext + 1)
        if ext < matched:
            self._tier_more.add(seq.request_id)
        else:
            self._tier_more.discard(seq.request_id)
        seq.num_computed_tokens += ext
        self.connector.update_state_after_alloc(seq, ext)
        if seq.num_computed_tokens <= before:
            return n
        return min(seq.num_uncomputed, budget, len(seq.block_table) * bs - seq.num_computed_tokens)

    def _load_more(self, seq: Sequence, n: int, budget: int) -> int:
        """Ask the connector again for the tokens of running ``seq`` it holds that found no blocks at admission,
        once its step has its blocks (``n`` tokens' worth): they load into those and any free blocks rather than
        being computed, and count as cached as those loaded at admission. Returns the tokens the step computes."""
        before = seq.num_computed_tokens
        n = self._load_external(seq, n, budget)
        self._count_cached(seq, before)
        return n

    @staticmethod
    def _count_cached(seq: Sequence, before: int) -> None:
        """Count as cached the prompt tokens ``seq`` got past ``before`` without computing them (a pool hit or a
        connector's load), leaving out those it had computed itself before a preemption: ``cached_tokens`` is
        every prompt token it did not compute, whichever admission found it."""
        p = len(seq.prompt_token_ids)
        start = min(max(before, seq.num_computed_before_preemption), p)
        seq.num_cached_tokens = max(seq.num_cached_tokens, 0) + max(0, min(seq.num_computed_tokens, p) - start)

    def _preempt(self, seq: Sequence) -> None:
        seq.num_computed_before_preemption = max(seq.num_computed_before_preemption, seq.num_computed_tokens)
        self.kv.free(seq)
        self._tier_more.discard(seq.request_id)  # asked again when it is admitted again
        self.unpin_lora(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.transition(Status.PREEMPTED)
        if self.cfg.policy == "priority":
            bisect.insort(self.waiting, seq, key=self.cfg.rank)
        else:
            self.waiting.appendleft(seq)  # it arrived before anything still waiting

    def finish(self, seq: Sequence, status: Status) -> None:
        """Free a sequence's blocks and move it to a finished state, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._tier_more.discard(seq.request_id)
        self.unpin_lora(seq)
        seq.transition(status)
