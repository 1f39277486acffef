"""Property tests of the engine core: any interleaving of add / step / abort never leaks or double-frees
a KV block, never counts a position as computed unless its KV slot holds that position's token, and
once everything finishes every block is free.

The engine is the real LLMEngine (scheduler, block pool, prefix cache, update from output, stops); only
the model is fake: :class:`FakeExecutor` writes each computed token id into its KV slot, "predicts" a
fixed token per position, and proposes drafts of which a varying prefix is right, so verification
accepts, rejects and adds bonus tokens. Tiny pools force preemption; prompts drawn from a few shared
prefixes force prefix-cache hits.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.executor import ModelOutput, Sampled
from fleetllm.engine.outputs import RequestOutput
from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.scheduler import QueueFull, Scheduled, SchedulerOutput
from fleetllm.engine.sequence import Sequence, Status
from fleetllm.models.config import ModelConfig

BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]


def truth(prompt: list[int], position: int) -> int:
    """The fake model's token at ``position`` after ``prompt``."""
    return 100 + (position + prompt[0]) % 7


def slot(seq: Sequence, position: int) -> int:
    return seq.block_table[position // BS] * BS + position % BS


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


class FakeModel:
    name = "fake"
    config = ModelConfig(architecture="llama", vocab_size=128, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=8)
    tokenizer = CharTokenizer()
    load_seconds = 0.0


class FakeExecutor:
    """Computes token ids instead of KV; greedy verification against :func:`truth`; checks what it is asked."""

    device, needs_warm_up, spec = "cpu", False, None
    loaded = FakeModel()

    def __init__(self, num_blocks: int, max_num_seqs: int, budget: int) -> None:
        self.num_blocks, self.max_num_seqs, self.budget = num_blocks, max_num_seqs, budget
        self.kv: dict[int, int] = {}  # slot -> the token id whose KV it holds
        self.num_verified = 0

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        assert 0 < sched.num_tokens <= self.budget
        assert len(sched.scheduled) <= self.max_num_seqs
        for s in sched.scheduled:
            seq, c = s.seq, s.seq.num_computed_tokens
            assert seq.status is Status.RUNNING and s.num_new_tokens >= 1
            assert len(seq.block_table) * BS >= c + s.num_new_tokens  # the scheduler reserved the room
            assert [self.kv.get(slot(seq, p)) for p in range(c)] == seq.all_token_ids[:c]  # computed = in the KV
            for p, tok in enumerate(s.token_ids(), c):
                self.kv[slot(seq, p)] = tok
        return ModelOutput({s.seq.request_id: Sampled(self._emit(s)) for s in sched.scheduled if s.num_logits})

    def _emit(self, s: Scheduled) -> list[int]:
        n, drafts = s.seq.num_tokens, s.draft_token_ids
        self.num_verified += bool(drafts)
        for i, d in enumerate(drafts):
            if d != truth(s.seq.prompt_token_ids, n + i):
                return drafts[:i] + [truth(s.seq.prompt_token_ids, n + i)]
        return drafts + [truth(s.seq.prompt_token_ids, n + len(drafts))]

    def propose(self, seqs: list[Sequence], max_model_len: int) -> dict[str, list[int]]:
        """0-3 drafts, the first ``right`` of them correct (both vary with the length)."""
        out = {}
        for seq in seqs:
            n = seq.num_tokens
            k = n % 4
            right = (n // 4) % (k + 1)
            out[seq.request_id] = [truth(seq.prompt_token_ids, n + i) + (i >= right) for i in range(k)]
        return out

    def forget(self, seq: Sequence) -> None:
        pass

    def kv_blocks(self) -> list:
        return []


class Harness:
    """The engine over the fake executor, with the invariants checked after every operation."""

    def __init__(self, num_blocks: int, max_num_seqs: int, budget: int, max_waiting: int = 64) -> None:
        self.executor = FakeExecutor(num_blocks, max_num_seqs, budget)
        cfg = EngineConfig(model="fake", block_size=BS, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=budget, max_waiting=max_waiting)
        self.engine = LLMEngine(cfg, executor=self.executor)
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # what came out, per request
        self.finished: list[RequestOutput] = []
        self.next_id = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        # the engine caps the context to what the pool holds: keep prompt + output within it
        max_tokens = min(max_tokens, self.engine.max_model_len - len(prompt))
        self.next_id += 1
        rid = f"r{self.next_id}"
        try:
            self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        except QueueFull:
            return
        self.prompts[rid], self.tokens[rid] = prompt, []

    def step(self) -> None:
        for out in self.engine.step():
            prompt, tokens = self.prompts[out.request_id], self.tokens[out.request_id]
            assert out.error is None, out.error  # the fake executor's own checks fail a step this way
            tokens += out.new_token_ids
            # drafts, preemption and prefix hits never change what comes out
            assert tokens == [truth(prompt, len(prompt) + i) for i in range(len(tokens))]
            if out.finished:
                self.finished.append(out)

    def abort(self, index: int) -> None:
        live = sorted(self.engine.seqs)
        if live:
            self.engine.abort_request(live[index % len(live)])

    def check(self) -> None:
        eng = self.engine
        refs = Counter(b for seq in eng.seqs.values() for b in seq.block_table)
        eng.pool.check(dict(refs))
        for seq in eng.seqs.values():
            assert not seq.status.finished
            if seq.status is not Status.RUNNING:  # only running sequences hold blocks or computed tokens
                assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq.num_computed_tokens <= seq.num_tokens
            assert len(set(seq.block_table)) == len(seq.block_table)  # no block twice in one table
            assert len(seq.block_hashes) * BS <= seq.num_computed_tokens  # only computed blocks are cached
        for bid in eng.pool.cached.values():  # a cached block holds the KV of exactly its tokens
            assert [self.executor.kv.get(bid * BS + i) for i in range(BS)] == list(eng.pool.blocks[bid].token_ids)
        queued = [s.request_id for s in eng.scheduler.running] + [s.request_id for s in eng.scheduler.waiting]
        assert sorted(queued) == sorted(eng.seqs)  # every live sequence is in exactly one queue

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                break
            self.step()
            self.check()
        assert not self.engine.has_unfinished(), "the engine made no progress"
        assert not self.engine.seqs
        assert self.engine.pool.num_free == self.engine.pool.num_blocks
        self.engine.pool.check({})


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


def run(h: Harness, operations: list[tuple]) -> None:
    for op in operations:
        if op[0] == "add":
            h.add(op[1], op[2])
        elif op[0] == "step":
            h.step()
        else:
            h.abort(op[1])
        h.check()
    h.drain()


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(operations=ops, num_blocks=st.integers(5, 12), max_num_seqs=st.integers(1, 4), budget=st.integers(1, 24))
def test_no_block_leaks_or_double_frees_under_any_interleaving(
    operations: list[tuple], num_blocks: int, max_num_seqs: int, budget: int
) -> None:
    run(Harness(num_blocks, max_num_seqs, budget), operations)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(operations=ops, budget=st.integers(4, 24))
def test_tiny_pools_preempt_without_leaking(operations: list[tuple], budget: int) -> None:
    run(Harness(num_blocks=5, max_num_seqs=4, budget=budget), operations)


@settings(max_examples=100, deadline=None)
@given(operations=ops)
def test_aborting_everything_frees_every_block(operations: list[tuple]) -> None:
    h = Harness(num_blocks=8, max_num_seqs=3, budget=16)
    for op in operations:
        if op[0] == "add":
            h.add(op[1], op[2])
        elif op[0] == "step":
            h.step()
        h.check()
    for rid in list(h.engine.seqs):
        h.engine.abort_request(rid)
        h.check()
    assert h.engine.pool.num_free == h.engine.pool.num_blocks
    h.drain()
    assert all(o.finish_reason in ("length", "abort") for o in h.finished)


def test_a_tiny_pool_does_preempt() -> None:
    h = Harness(num_blocks=5, max_num_seqs=4, budget=64)
    for i in range(3):
        h.add([50 + i] * 6, 10)
    h.drain()
    assert h.engine.scheduler.num_preemptions > 0
    assert [(o.finish_reason, o.num_output_tokens) for o in h.finished] == [("length", 10)] * 3


def test_drafts_are_verified_and_never_pass_max_tokens() -> None:
    h = Harness(num_blocks=32, max_num_seqs=4, budget=64)
    h.add(PREFIXES[0], 20)
    h.drain()
    assert h.executor.num_verified > 0
    assert [(o.finish_reason, o.num_output_tokens) for o in h.finished] == [("length", 20)]


def test_shared_prefixes_hit_the_prefix_cache() -> None:
    h = Harness(num_blocks=16, max_num_seqs=4, budget=64)
    h.add(PREFIXES[0] + [31, 32], 2)
    h.drain()
    h.add(PREFIXES[0] + [33], 2)
    h.step()
    (second,) = h.engine.scheduler.running
    assert second.num_cached_tokens == 8
    h.drain()
    assert h.engine.kv.prefix_hits == 8


def test_a_full_queue_refuses_new_sequences() -> None:
    h = Harness(num_blocks=8, max_num_seqs=1, budget=16, max_waiting=1)
    h.engine.add_request("a", [1], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFull):
        h.engine.add_request("b", [1], SamplingParams(max_tokens=1))
    assert list(h.engine.seqs) == ["a"]
