"""A prompt prefilled on one engine and handed over to another with its first token (no HTTP).

Engine ``a`` prefills the whole prompt (64-token chunks) and samples the first token with the request's
own parameters while a layer stream writes a frame; engine ``b`` imports the frame holding every block
(the partial last one too) and takes the request over from that first token. Its outputs must be the
colocated ones (engine ``c``, configured as ``b``) token for token, its stops and usage those of a local
prefill, and nothing may be left held.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetllm.disagg import frame
from fleetllm.disagg.connector import pd_connector
from fleetllm.disagg.kv_io import commit_held, frame_header, reserve, write
from fleetllm.disagg.layer_stream import LayerStream
from fleetllm.engine.block_pool import hash_prefix_blocks
from fleetllm.engine.engine import EngineConfig, LLMEngine, RequestOutput
from fleetllm.engine.handoff import Handoff
from fleetllm.engine.params import SamplingParams
from fleetllm.models.loader import LoadedModel

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how books "
        "were made, sold and read across Europe; summarise the consequences in three points, then add a fourth.")


@pytest.fixture(scope="module")
def engines(loaded_model: LoadedModel) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    # batch-invariant kernels: a prompt prefilled in chunks of 64 here and whole there takes the same arithmetic;
    # fp32 pools (whatever auto is on the fast path): a chunk attends over its own K/V as computed, the next one reads them
    # back from the pool, so a narrower pool's rounding would enter at different points here and there
    pin = {"num_blocks": 256, "batch_invariant": True, "kv_cache_dtype": "fp32"}
    a = LLMEngine(EngineConfig(max_num_batched_tokens=64, **pin), loaded=loaded_model)
    b = LLMEngine(EngineConfig(**pin), loaded=loaded_model)
    c = LLMEngine(EngineConfig(**pin), loaded=loaded_model)
    return a, b, c


@pytest.fixture(autouse=True)
def nothing_held(engines):
    yield
    for e in engines:
        assert not e.has_unfinished() and e.pool.num_free == e.pool.num_blocks
        e.pool.check({})


def prompt(engines, n: int) -> list[int]:
    ids = engines[0].tokenizer.encode(TEXT * 4)
    assert len(ids) >= n
    return ids[:n]


def drain(engine: LLMEngine, outs: list[RequestOutput] | None = None) -> list[RequestOutput]:
    outs = list(outs or [])
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def local(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(rid, ids, params)
    outs = drain(engine)
    engine.pool.reset_prefix_cache()  # the next run computes the prompt again, as a colocated one would
    return outs


def hand_over(a: LLMEngine, b: LLMEngine, label: str, ids: list[int], params: SamplingParams) -> Handoff:
    """Prefill ``ids`` on ``a`` (one token sampled with ``params``), its KV into ``b``'s pool, held."""
    header = frame_header(a, ids, hash_prefix_blocks(ids, 16, a.kv.extra_key), tail=True)
    fb = frame.FrameBuffer(header, bytearray(header.frame_bytes()))
    stream = LayerStream(fb)
    pd_connector(a).observe(label, stream)
    try:
        a.add_request(label, ids, replace(params, max_tokens=1))
        (out,) = [o for o in drain(a) if o.finished]
        stream.done.result(timeout=30)
    finally:
        pd_connector(a).observe(label, None)
        stream.close()
    a.pool.reset_prefix_cache()
    header, layers = frame.decode(bytes(fb.mv))
    res = reserve(b, header)
    write(b.kv_blocks(), layers, res)
    _, table = commit_held(b, res)
    assert table is not None
    return Handoff(ids, table, header.block_hashes, out.new_token_ids[0], out.logprobs[0] if out.logprobs else None,
                   out.sampler_state)


def remote(engines, rid: str, ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    a, b, _ = engines
    b.add_request(rid, ids, params, handoff=hand_over(a, b, rid, ids, params))
    first = b.take_outputs()  # out before any step of b
    assert [len(o.new_token_ids) for o in first] == [1]
    outs = drain(b, first)
    b.pool.reset_prefix_cache()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


@pytest.mark.parametrize("n", [48, 45])  # a multiple of the block size, and a partial last block
def test_a_handed_over_prompt_decodes_the_colocated_tokens(engines, n):
    ids, params = prompt(engines, n), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want, got = local(engines[2], "local", ids, params), remote(engines, "remote", ids, params)
    assert tokens(got) == tokens(want) and text(got) == text(want)
    assert got[-1].num_cached_tokens == n and got[-1].num_prompt_tokens == n  # usage: every prompt token came in
    assert got[-1].num_output_tokens == 10 and got[-1].finish_reason == "length"


def test_a_prefill_ending_in_a_chunk_of_a_few_tokens_is_handed_over_whole(engines):
    # 64-token chunks on a: the last one is 3 tokens over 128 computed (a step shape q4's fused decode stack
    # also takes; the runner keeps observed steps layer by layer so that every layer's KV is streamed)
    ids, params = prompt(engines, 131), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert tokens(remote(engines, "remote", ids, params)) == tokens(local(engines[2], "local", ids, params))


def test_a_seeded_request_continues_from_the_state_its_first_draw_left(engines):
    ids, params = prompt(engines, 45), SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    assert tokens(remote(engines, "remote", ids, params)) == tokens(local(engines[2], "local", ids, params))


def test_logprobs_of_the_first_token_come_from_the_prefill(engines):
    ids, params = prompt(engines, 45), SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    want, got = local(engines[2], "local", ids, params), remote(engines, "remote", ids, params)
    lw = [lp for o in want for lp in o.logprobs]
    lg = [lp for o in got for lp in o.logprobs]
    assert [x.token_id for x in lg] == [x.token_id for x in lw]
    assert [[t for t, _ in x.top] for x in lg] == [[t for t, _ in x.top] for x in lw]
    # a's observed prefill runs op by op (torch's norms, RoPE, SiLU), c's the C decode stack: the same GEMM and
    # attention kernels, other rounding elsewhere, so b decodes over KV ~1e-6 apart (measured: up to 2.3e-3 in
    # logprob; KV gone astray would be whole nats apart)
    assert all(abs(x.logprob - y.logprob) < 5e-3 for x, y in zip(lg, lw, strict=True))


def test_max_tokens_one_finishes_with_the_handed_over_token_and_no_step(engines):
    a, b, c = engines
    ids, params = prompt(engines, 45), SamplingParams(max_tokens=1, temperature=0.0)
    want = local(c, "local", ids, params)
    b.add_request("remote", ids, params, handoff=hand_over(a, b, "remote", ids, params))
    (out,) = b.take_outputs()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == tokens(want)
    assert not b.has_unfinished()
    b.pool.reset_prefix_cache()


@pytest.mark.parametrize("how", ["stop_string", "stop_token"])
def test_a_stop_on_the_first_token_ends_the_request_there(engines, how):
    ids = prompt(engines, 45)
    first = tokens(local(engines[2], "probe", ids, SamplingParams(max_tokens=1, temperature=0.0)))[0]
    stop = ({"stop": [engines[2].tokenizer.decode([first])]} if how == "stop_string"
            else {"stop_token_ids": [first]})
    params = SamplingParams(max_tokens=8, temperature=0.0, **stop)
    want, got = local(engines[2], "local", ids, params), remote(engines, "remote", ids, params)
    assert got[-1].finish_reason == want[-1].finish_reason == "stop"
    assert tokens(got) == tokens(want) == [first] and text(got) == text(want)


def test_the_partial_block_never_enters_the_prefix_cache(engines):
    a, b, _ = engines
    ids = prompt(engines, 45)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # 47 tokens: block 2 never fills
    h = hand_over(a, b, "remote", ids, params)
    assert [b.pool.blocks[bid].hash for bid in h.blocks] == [*h.hashes, None]  # the full ones are cached at once
    b.add_request("remote", ids, params, handoff=h)
    drain(b, b.take_outputs())
    assert b.pool.blocks[h.blocks[-1]].hash is None
    blocks, _ = b.kv.cached_prefix(ids + [1] * 16)
    assert len(blocks) == 2  # the two full blocks only
    b.pool.reset_prefix_cache()


def test_a_handoff_for_another_prompt_is_freed_and_the_request_prefills_here(engines):
    a, b, c = engines
    ids, params = prompt(engines, 45), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    other = hand_over(a, b, "other", prompt(engines, 44), params)
    b.add_request("remote", ids, params, handoff=other)
    assert b.take_outputs() == []  # nothing taken over: it waits for its prefill like any request
    assert tokens(drain(b)) == tokens(local(c, "local", ids, params))
    b.pool.reset_prefix_cache()


def test_an_aborted_handed_over_request_frees_its_blocks(engines):
    a, b, _ = engines
    ids, params = prompt(engines, 45), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    b.add_request("remote", ids, params, handoff=hand_over(a, b, "remote", ids, params))
    b.step()
    b.abort_request("remote")
    assert drain(b, b.take_outputs())[-1].finish_reason == "abort"
    b.pool.reset_prefix_cache()
