"""A prefill computed in another engine's pool blocks (a direct write in place): the same KV, the same first
token, a step of its own, nothing of it cached where it was computed, and no step over stale blocks.

Two in-process engines over the session's weights: ``here`` computes, its stream's target being blocks of
``there``'s pool (as a prefill worker's are a decode worker's, mapped); ``there`` also prefills the same prompt
itself, the reference.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fleetllm.disagg.connector import PDConnector, pd_connector
from fleetllm.disagg.direct import PoolTarget
from fleetllm.disagg.kv_io import frame_header
from fleetllm.disagg.layer_stream import LayerStream
from fleetllm.engine.block_pool import BlockPool, hash_prefix_blocks
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.scheduler import Scheduler, SchedulerConfig
from fleetllm.engine.sequence import Sequence, Status
from fleetllm.kernels import kv8

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def engines(loaded_model):
    here = LLMEngine(EngineConfig(num_blocks=96, max_num_batched_tokens=64), loaded=loaded_model)
    there = LLMEngine(EngineConfig(num_blocks=160, max_num_batched_tokens=512), loaded=loaded_model)
    return here, there


def run(engine: LLMEngine, rid: str, ids: list[int]) -> int:
    engine.add_request(rid, ids, GREEDY)
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.request_id == rid]
    assert out[-1].finished and not out[-1].error, out[-1]
    return out[-1].new_token_ids[0] if out[-1].new_token_ids else -1


def in_place_stream(here: LLMEngine, there: LLMEngine, ids: list[int]) -> LayerStream:
    """A stream computing ``ids`` in blocks ``there`` holds for it (as a lease would; the first two swapped: not
    one run), the partial last block included."""
    hashes = hash_prefix_blocks(ids, here.pool.block_size, here.kv.extra_key)
    header = frame_header(here, ids, hashes, tail=True)
    blocks = there.pool.allocate(header.num_blocks)
    blocks[0], blocks[1] = blocks[1], blocks[0]
    return LayerStream(PoolTarget(header, there.kv_blocks(), blocks, math.inf), in_place=True)


def kv_of(engine_views: list, blocks: list[int], n: int, bs: int) -> torch.Tensor:
    """K and V of the first ``n`` positions held in ``blocks``, every layer (8-bit rows as the values they hold)."""
    idx = torch.tensor(blocks, dtype=torch.long)
    parts = [kv8.convert(t.index_select(0, idx).flatten(0, 1)[:n], torch.float32)
             for k, v in engine_views for t in (k, v)]
    return torch.stack(parts)


def assert_same_kv(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same KV up to float rounding: two engines prefilling one prompt differ by ~0.3% (relative norm, their
    reductions' order); a block out of place differs by ~90%."""
    assert float((a - b).norm() / b.norm()) < 0.02


def test_a_prompt_computed_in_another_pool_holds_the_kv_and_first_token_of_a_local_prefill(engines) -> None:
    here, there = engines
    ids = [(7 * i) % 3000 + 100 for i in range(150)]  # 3 steps of 64 here, the last block partial
    stream = in_place_stream(here, there, ids)
    pd_connector(here).observe("placed", stream)
    first = run(here, "placed", ids)
    pd_connector(here).observe("placed", None)
    stream.done.result(timeout=30)
    assert first == run(there, "local", ids)
    local = there.kv.cached_prefix(ids)[0]  # the reference's full blocks, cached there
    assert len(local) == 150 // 16
    placed = stream.target.blocks
    n = len(local) * 16
    assert_same_kv(kv_of(there.kv_blocks(), placed[: len(local)], n, 16), kv_of(there.kv_blocks(), local, n, 16))
    # nothing of it is cached where it was computed: those blocks hold nothing of it
    assert here.kv.cached_prefix(ids) == ([], [])
    here.pool.check()


def test_blocks_computed_here_before_are_copied_into_the_other_pool_first(engines) -> None:
    here, there = engines
    ids = [(11 * i) % 3000 + 200 for i in range(140)]
    run(here, "warm", ids[:96])  # 6 full blocks of the prompt cached here: prefix hits
    stream = in_place_stream(here, there, ids)
    pd_connector(here).observe("hits", stream)
    first = run(here, "hits", ids)
    pd_connector(here).observe("hits", None)
    assert first == run(there, "local-hits", ids)
    local = there.kv.cached_prefix(ids)[0]
    n = len(local) * 16
    assert_same_kv(kv_of(there.kv_blocks(), stream.target.blocks[: len(local)], n, 16),
                   kv_of(there.kv_blocks(), local, n, 16))


def test_a_sequence_computed_elsewhere_runs_in_a_step_of_its_own() -> None:
    kv = KVCacheManager(BlockPool(64, 4), enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32), kv)
    a, b, c = (Sequence(r, list(range(1, 21)), GREEDY, 1) for r in "abc")
    s.connector = conn = PDConnector()
    conn.observe("b", LayerStream(SimpleNamespace(), in_place=True))  # b computed in another pool
    for seq in (a, b, c):
        s.add(seq)
    steps = []
    for _ in range(5):
        out = s.schedule()
        steps.append([(x.seq.request_id, x.num_new_tokens) for x in out.scheduled])
        for x in out.scheduled:
            x.seq.num_computed_tokens += x.num_new_tokens
            if x.seq.num_uncomputed == 0:
                s.finish(x.seq, Status.FINISHED_LENGTH)
    # a takes 20 of 32; b waits (not admitted beside a), then runs alone; c only after b
    assert steps[:3] == [[("a", 20)], [("b", 20)], [("c", 20)]]


def test_a_step_over_stale_blocks_fails_that_request_alone(engines) -> None:
    here, there = engines
    ids = [(13 * i) % 3000 + 300 for i in range(150)]
    stream = in_place_stream(here, there, ids)
    pd_connector(here).observe("orphan", stream)
    here.add_request("orphan", ids, GREEDY)
    here.step()  # its first 64 tokens computed in the other pool
    stream.target.close()  # the writer gave up: the blocks here hold nothing of those 64 tokens
    outs = []
    while here.has_unfinished():
        outs += here.step()
    pd_connector(here).observe("orphan", None)
    (out,) = [o for o in outs if o.request_id == "orphan" and o.finished]
    assert out.error and "another worker's pool" in out.error
    here.pool.check()
    assert run(here, "after", ids[:40]) >= 0  # the engine goes on
