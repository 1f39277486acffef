"""The KV connector seam (fleetllm/engine/kv_connector/): the scheduler counts what a connector loads as
computed, and the model runner drives its worker side layer by layer only when the step's metadata asks."""

from __future__ import annotations

import torch

from fleetllm.engine.block_pool import BlockPool
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.kv_connector import KVConnectorBase, KVConnectorMetadata, StepKV
from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from fleetllm.engine.sequence import Sequence, Status
from fleetllm.models.loader import LoadedModel

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


class Loads(KVConnectorBase):
    """Claims ``matched`` tokens of every request can be loaded from outside."""

    def __init__(self, matched: int) -> None:
        self.matched = matched
        self.allocated: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        return self.matched

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        self.allocated.append((seq.request_id, num_external_tokens))


def test_tokens_a_connector_loads_count_as_computed_and_cached_and_the_step_computes_the_rest() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32), KVCacheManager(BlockPool(16, 4), False))
    s.connector = conn = Loads(8)
    seq = Sequence("a", list(range(1, 21)), GREEDY, 2)
    s.add(seq)
    (x,) = s.schedule().scheduled
    assert (seq.num_computed_tokens, seq.num_cached_tokens, x.num_new_tokens) == (8, 8, 12)
    assert conn.allocated == [("a", 8)]
    assert len(seq.block_table) * 4 >= 20  # blocks for the loaded tokens and the computed ones


def test_a_connector_never_loads_the_token_a_step_must_compute() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32), KVCacheManager(BlockPool(16, 4), False))
    s.connector = Loads(100)
    seq = Sequence("a", list(range(1, 21)), GREEDY, 2)
    s.add(seq)
    (x,) = s.schedule().scheduled
    assert (seq.num_computed_tokens, x.num_new_tokens) == (19, 1)


class Watches(KVConnectorBase):
    """Asks for per-layer hooks in every step of ``watched``; records what the worker side was told."""

    def __init__(self, watched: str) -> None:
        self.watched = watched
        self.calls: list[tuple[str, int]] = []
        self.finished: list[str] = []

    def build_connector_meta(self, sched: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata(per_layer=any(s.seq.request_id == self.watched for s in sched.scheduled))

    def start_load_kv(self, meta: KVConnectorMetadata, kv_cache: list) -> StepKV | None:
        self.calls.append(("start", int(meta.per_layer)))
        return None

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append(("load", layer))

    def save_kv_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.calls.append(("save", layer))

    def wait_for_save(self) -> None:
        self.calls.append(("saved", -1))

    def request_finished(self, seq: Sequence) -> None:
        self.finished.append(seq.request_id)


def test_the_worker_side_sees_each_layer_loaded_then_saved_only_in_steps_that_ask(loaded_model: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=32), loaded=loaded_model)
    engine.set_kv_connector(conn := Watches("watched"))
    layers = loaded_model.config.num_layers
    for rid in ("plain", "watched"):
        engine.add_request(rid, [5, 6, 7, 8], GREEDY)
        while engine.has_unfinished():
            engine.step()
    per_layer = [c for i in range(layers) for c in (("load", i), ("save", i))]
    # two steps each (the prompt, one decode): the plain request's without hooks, the watched one's with them
    assert conn.calls == [("start", 0), ("start", 0), *(2 * [("start", 1), *per_layer, ("saved", -1)])]
    assert conn.finished == ["plain", "watched"]
    assert engine.kv_connector is conn and engine.pool.num_free == engine.pool.num_blocks


class Holds(KVConnectorBase):
    """Says it holds ``held`` tokens of every request (past those computed) and loads ``loads[request id]``."""

    def __init__(self, held: int = 0, loads: dict[str, int] | None = None) -> None:
        self.held, self.loads = held, loads or {}

    def num_held_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        return self.held

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        return self.loads.get(seq.request_id, 0)


def test_a_waiting_requests_prefix_a_connector_holds_is_left_out_of_the_queued_prefill_tokens() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32), KVCacheManager(BlockPool(16, 4), False))
    s.connector = Holds(held=8)
    s.add(Sequence("a", list(range(1, 21)), GREEDY, 2))
    assert s.queued_prefill_tokens() == 12  # 20 prompt tokens, 8 of them a load, not work


def step(s: Scheduler) -> None:
    """One step as the engine runs it: each scheduled sequence computes its tokens, emitting one once its
    prompt is done."""
    for x in s.schedule().scheduled:
        x.seq.num_computed_tokens += x.num_new_tokens
        if x.seq.num_computed_tokens == x.seq.num_tokens:
            x.seq.append_output(7, 0.0)


def test_tokens_a_preempted_request_loads_at_readmission_count_as_cached_past_those_it_computed() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, watermark=0.0), KVCacheManager(BlockPool(4, 4), False))
    s.connector = conn = Holds()
    a, b = Sequence("a", [1, 2, 3, 4], GREEDY, 8), Sequence("b", list(range(10, 22)), GREEDY, 2)
    s.add(a)
    s.add(b)
    step(s)  # a's prompt and b's first 4 tokens computed
    step(s)  # a decodes into a second block; b's next chunk finds no block: b, the newest, is preempted
    assert b.status is Status.PREEMPTED and b.num_cached_tokens == 0
    s.finish(a, Status.FINISHED_STOPPED)
    conn.loads["b"] = 11  # its whole prompt but the last token, held outside now
    step(s)
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 7  # 11 loaded, 4 of them computed by b before
