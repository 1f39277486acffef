"""LLMEngine end to end with the real model (in-process, no HTTP): stop conditions, finish reasons,
logprobs, n > 1, seeds, aborts, and the checks that refuse a request before it is queued."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from fleetllm.engine.engine import EngineConfig, LLMEngine, PromptTooLong, RequestOutput
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import InvalidParameter, SamplingParams
from fleetllm.engine.scheduler import QueueFull
from fleetllm.errors import UsageError
from fleetllm.models.loader import LoadedModel

MAX_MODEL_LEN = 128
PROMPT = "The days of the week are Monday, Tuesday,"


@pytest.fixture(scope="module")
def llm(loaded_model: LoadedModel) -> Iterator[LLM]:
    yield LLM(loaded=loaded_model, num_blocks=64, max_model_len=MAX_MODEL_LEN, max_waiting=4)


@pytest.fixture(autouse=True)
def engine_left_clean(llm: LLM) -> Iterator[None]:
    """Every test leaves the engine with no request and every block free."""
    yield
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.pool.num_free == eng.pool.num_blocks
    eng.pool.check({})


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(llm: LLM) -> tuple[str, list[int]]:
    """The greedy continuation of PROMPT (text and token ids) that the stop tests cut."""
    (res,) = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True))
    return res.outputs[0].text, res.outputs[0].token_ids


def drain(llm: LLM) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while llm.engine.has_unfinished():
        outs.extend(llm.engine.step())
    return outs


def test_max_tokens_ends_with_finish_reason_length(llm: LLM) -> None:
    (res,) = llm.generate(PROMPT, greedy(max_tokens=3, ignore_eos=True))
    assert len(res.outputs[0].token_ids) == 3
    assert res.outputs[0].finish_reason == "length"


def test_greedy_generation_is_deterministic(llm: LLM, reference: tuple[str, list[int]]) -> None:
    (res,) = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True))
    assert res.outputs[0].token_ids == reference[1]


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(llm: LLM, reference: tuple[str, list[int]]) -> None:
    text = reference[0]
    stop = text.strip().split()[1]  # a word the greedy continuation is known to contain
    (res,) = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True, stop=[stop]))
    out = res.outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_include_stop_str_in_output_keeps_the_stop_string(llm: LLM, reference: tuple[str, list[int]]) -> None:
    text = reference[0]
    stop = text.strip().split()[1]
    (res,) = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert res.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_a_stop_token_id_finishes_with_stop(llm: LLM, reference: tuple[str, list[int]]) -> None:
    stop_id = reference[1][2]
    (res,) = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]))
    out = res.outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert out.token_ids == reference[1][: reference[1].index(stop_id) + 1]


def test_logprobs_count_matches_the_request(llm: LLM) -> None:
    (res,) = llm.generate(PROMPT, greedy(max_tokens=3, ignore_eos=True, logprobs=2))
    lps = res.outputs[0].logprobs
    assert lps is not None and len(lps) == 3
    for lp, tok in zip(lps, res.outputs[0].token_ids, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 2
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob <= 0


def test_n_greater_than_one_gives_n_completions(llm: LLM) -> None:
    (res,) = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    assert [c.index for c in res.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 for c in res.outputs)
    assert len({tuple(c.token_ids) for c in res.outputs}) > 1  # different seeds per choice


def test_the_same_seed_reproduces_a_sampled_completion(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=6, ignore_eos=True)
    (a,) = llm.generate(PROMPT, p)
    (b,) = llm.generate(PROMPT, p)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_request_whose_parameters_break_the_step_fails_alone(llm: LLM, reference: tuple[str, list[int]]) -> None:
    eng, ids = llm.engine, llm.engine.tokenizer.encode(PROMPT)
    for i in range(3):
        eng.add_request(f"innocent-{i}", ids, greedy(max_tokens=8, ignore_eos=True))
    eng.add_request("hostile", ids, SamplingParams(temperature=0.8, top_k=5, max_tokens=8))
    eng.seqs["hostile"].params.top_k = 2**63  # past every check, as a bug would let it through: sampling raises
    tokens: dict[str, list[int]] = {}
    finals = {}
    for out in drain(llm):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out
    assert finals["hostile"].finish_reason == "error" and "top_k" in finals["hostile"].error
    for i in range(3):
        assert finals[f"innocent-{i}"].finish_reason == "length" and finals[f"innocent-{i}"].error is None
        assert tokens[f"innocent-{i}"] == reference[1]


def test_a_repeated_prompt_is_served_from_the_prefix_cache(llm: LLM) -> None:
    ids = list(range(1000, 1040))
    llm.generate([ids], greedy(max_tokens=1))
    (res,) = llm.generate([ids], greedy(max_tokens=1))
    assert res.num_cached_tokens == 32  # two whole blocks; the hit stops short of the last token


def test_aborting_a_running_request_frees_its_blocks(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("abort-me", list(range(100, 140)), greedy(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.pool.num_free < eng.pool.num_blocks
    eng.abort_request("abort-me")
    outs = drain(llm)
    assert [o.finish_reason for o in outs if o.finished] == ["abort"]


def test_aborting_a_waiting_request_finishes_it_with_abort(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("waiting", [5, 6, 7], greedy(max_tokens=2))
    eng.abort_request("waiting")
    outs = drain(llm)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("waiting", "abort")]


def test_a_prompt_as_long_as_the_context_is_refused(llm: LLM) -> None:
    with pytest.raises(PromptTooLong):
        llm.engine.add_request("long", [1] * MAX_MODEL_LEN, greedy(max_tokens=1))


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(llm: LLM) -> None:
    with pytest.raises(PromptTooLong):
        llm.engine.add_request("long", [1] * 100, greedy(max_tokens=MAX_MODEL_LEN))


def test_without_max_tokens_generation_stops_at_the_context_length(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("fill", [1] * (MAX_MODEL_LEN - 3), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    (last,) = [o for o in drain(llm) if o.finished]
    assert last.finish_reason == "length"
    assert last.num_output_tokens == 3


@pytest.mark.parametrize("ids", [[], [-1], [10**9]])
def test_empty_or_out_of_vocabulary_prompts_are_refused(llm: LLM, ids: list[int]) -> None:
    with pytest.raises(InvalidParameter):
        llm.engine.add_request("bad", ids, greedy(max_tokens=1))


def test_a_duplicate_request_id_is_refused(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("dup", [1, 2], greedy(max_tokens=1))
    with pytest.raises(InvalidParameter):
        eng.add_request("dup", [1, 2], greedy(max_tokens=1))
    drain(llm)


def test_a_full_queue_refuses_and_queues_nothing(llm: LLM) -> None:
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"q{i}", [1, 2, 3], greedy(max_tokens=1))
    with pytest.raises(QueueFull):
        eng.add_request("q-extra", [1, 2, 3], greedy(max_tokens=1))
    assert "q-extra" not in eng.seqs
    outs = drain(llm)
    assert sorted(o.request_id for o in outs if o.finished) == ["q0", "q1", "q2", "q3"]


def test_the_context_length_is_capped_to_what_the_kv_pool_holds(llm: LLM) -> None:
    cfg = EngineConfig(model="smollm2-135m", num_blocks=4, block_size=16)  # 64 tokens of KV
    small = LLMEngine(cfg, loaded=llm.engine.loaded)
    assert small.max_model_len == 64
    with pytest.raises(PromptTooLong):
        small.add_request("too-big", [1] * 100, greedy(max_tokens=1))


def test_a_request_filling_the_whole_pool_runs_to_completion(llm: LLM) -> None:
    small = LLMEngine(EngineConfig(model="smollm2-135m", num_blocks=4, block_size=16), loaded=llm.engine.loaded)
    small.add_request("fill", [1] * 60, greedy(max_tokens=4, ignore_eos=True))
    outs = []
    for _ in range(20):  # bounded: a request that cannot fit would spin forever
        outs.extend(small.step())
        if not small.has_unfinished():
            break
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    assert small.pool.num_free == small.pool.num_blocks


def test_a_context_the_kv_pool_cannot_hold_is_refused_with_the_pool_it_needs(loaded_model: LoadedModel) -> None:
    with pytest.raises(UsageError, match=r"--max-model-len 1024: .* give --num-blocks (\d+) or more") as refused:
        LLMEngine(EngineConfig(num_blocks=16, max_model_len=1024), loaded=loaded_model)
    need = int(re.search(r"--num-blocks (\d+)", str(refused.value)).group(1))
    assert LLMEngine(EngineConfig(num_blocks=need, max_model_len=1024), loaded=loaded_model).max_model_len == 1024
