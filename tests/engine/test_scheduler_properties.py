"""Property tests: any interleaving of add / step / abort over the scheduler and block pool never leaks
or double-frees a KV block, and once everything finishes every block is free.

No model: a step "computes" what the scheduler asked for (bumps num_computed_tokens, caches full blocks,
appends a fake output token when a sequence is fully computed), exactly the bookkeeping LLMEngine does.
Tiny pools force preemption; prompts drawn from a few shared prefixes force prefix-cache hits.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine.block_pool import BlockPool
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from fleetllm.engine.sequence import Sequence, Status

BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]


class Sim:
    """The scheduler plus the engine's bookkeeping, with the invariants checked after every operation."""

    def __init__(self, num_blocks: int, max_num_seqs: int, budget: int, max_waiting: int = 64) -> None:
        self.pool = BlockPool(num_blocks, BS)
        self.kv = KVCacheManager(self.pool)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_waiting, watermark=0.0), self.kv)
        self.live: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.next_id = 0
        self.capacity_tokens = num_blocks * BS

    def add(self, prompt: list[int], max_tokens: int) -> None:
        # a request that could never fit the whole pool would wait forever: the engine's context limit
        # plays this role for real, so keep prompt + output within the pool
        max_tokens = max(1, min(max_tokens, self.capacity_tokens - len(prompt)))
        seq = Sequence(f"r{self.next_id}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
        self.next_id += 1
        try:
            self.sched.add(seq)
        except QueueFull:
            return
        self.live[seq.request_id] = seq

    def step(self) -> None:
        out = self.sched.schedule()
        for p in out.preempted:
            assert p.status is Status.PREEMPTED and p.block_table == [] and p.num_computed_tokens == 0
        for s in out.scheduled:
            seq = s.seq
            assert seq.status is Status.RUNNING
            assert s.num_new_tokens >= 1
            # the scheduler reserved room for what it asked to compute
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + s.num_new_tokens
        assert out.num_tokens <= self.sched.cfg.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.cfg.max_num_seqs
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:  # fully computed: sample one fake token
                seq.output_token_ids.append(100 + len(seq.output_token_ids) % 7)
                if len(seq.output_token_ids) >= seq.max_tokens:
                    self._finish(seq, Status.FINISHED_LENGTH)

    def abort(self, index: int) -> None:
        if not self.live:
            return
        rid = sorted(self.live)[index % len(self.live)]
        self._finish(self.live[rid], Status.FINISHED_ABORTED)

    def _finish(self, seq: Sequence, status: Status) -> None:
        self.sched.finish(seq, status)
        assert seq.block_table == []
        del self.live[seq.request_id]
        self.finished.append(seq)

    def check(self) -> None:
        refs = Counter(b for seq in self.live.values() for b in seq.block_table)
        self.pool.check(dict(refs))
        for seq in self.live.values():
            assert not seq.status.finished
            if seq.status is not Status.RUNNING:
                assert seq.block_table == []  # only running sequences hold blocks
            assert len(set(seq.block_table)) == len(seq.block_table)  # no block twice in one table
            assert len(seq.block_hashes) <= len(seq.block_table)
        queued = [s.request_id for s in self.sched.running] + [s.request_id for s in self.sched.waiting]
        assert sorted(queued) == sorted(self.live)  # every live sequence is in exactly one queue

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                break
            self.step()
            self.check()
        assert not self.sched.has_work(), "the scheduler made no progress"
        assert not self.live
        assert self.pool.num_free == self.pool.num_blocks
        self.pool.check({})


prompts = st.builds(
    lambda prefix, tail: prefix + tail,
    st.sampled_from([[], *PREFIXES]),
    st.lists(st.integers(30, 40), min_size=0, max_size=9),
).filter(bool)

add = st.tuples(st.just("add"), prompts, st.integers(1, 24))
step = st.tuples(st.just("step"))
abort = st.tuples(st.just("abort"), st.integers(0, 100))
# adds and steps dominate so several sequences compete for blocks; the list is drained at the end
ops = st.lists(st.one_of(add, add, step, step, step, abort), min_size=4, max_size=80)


def run(sim: Sim, operations: list[tuple]) -> None:
    for op in operations:
        if op[0] == "add":
            sim.add(op[1], op[2])
        elif op[0] == "step":
            sim.step()
        else:
            sim.abort(op[1])
        sim.check()
    sim.drain()


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(operations=ops, num_blocks=st.integers(5, 12), max_num_seqs=st.integers(1, 4), budget=st.integers(1, 24))
def test_no_block_leaks_or_double_frees_under_any_interleaving(
    operations: list[tuple], num_blocks: int, max_num_seqs: int, budget: int
) -> None:
    run(Sim(num_blocks, max_num_seqs, budget), operations)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(operations=ops, budget=st.integers(4, 24))
def test_tiny_pools_preempt_without_leaking(operations: list[tuple], budget: int) -> None:
    sim = Sim(num_blocks=5, max_num_seqs=4, budget=budget)
    run(sim, operations)


@settings(max_examples=100, deadline=None)
@given(operations=ops)
def test_aborting_everything_frees_every_block(operations: list[tuple]) -> None:
    sim = Sim(num_blocks=8, max_num_seqs=3, budget=16)
    for op in operations:
        if op[0] == "add":
            sim.add(op[1], op[2])
        elif op[0] == "step":
            sim.step()
        sim.check()
    for rid in list(sim.live):
        sim.abort(sorted(sim.live).index(rid))
        sim.check()
    assert sim.pool.num_free == sim.pool.num_blocks


def test_a_tiny_pool_does_preempt() -> None:
    sim = Sim(num_blocks=5, max_num_seqs=4, budget=64)
    for i in range(3):
        sim.add([50 + i] * 6, 10)
    sim.drain()
    assert sim.sched.num_preemptions > 0
    assert all(s.status is Status.FINISHED_LENGTH for s in sim.finished)
    assert all(len(s.output_token_ids) == 10 for s in sim.finished)


def test_shared_prefixes_hit_the_prefix_cache() -> None:
    sim = Sim(num_blocks=16, max_num_seqs=4, budget=64)
    sim.add(PREFIXES[0] + [31, 32], 2)
    sim.drain()
    sim.add(PREFIXES[0] + [33], 2)
    sim.step()
    (second,) = [s for s in sim.sched.running]
    assert second.num_cached_tokens == 8
    sim.drain()
    assert sim.kv.prefix_hits == 8


def test_a_full_queue_refuses_new_sequences() -> None:
    sim = Sim(num_blocks=8, max_num_seqs=1, budget=16, max_waiting=1)
    sim.sched.add(Sequence("a", [1], SamplingParams(), 1))
    try:
        sim.sched.add(Sequence("b", [1], SamplingParams(), 1))
    except QueueFull:
        pass
    else:
        raise AssertionError("the second sequence should not fit the queue")
