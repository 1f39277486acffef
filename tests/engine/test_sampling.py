"""The sampler on hand-made logits: greedy, top-k / top-p / min-p filtering, seeds, penalties, logprobs;
and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from fleetllm.engine.sampling import InvalidParameter, Sampler, SampleResult, SamplingParams

V = 8
LOGITS = torch.tensor([1.0, 3.0, 0.5, 2.9, -1.0, 0.0, 2.0, 1.5])  # argmax 1, runner-up 3
ARGMAX = 1


def sample(logits: torch.Tensor, *params: SamplingParams, seeds: list[int | None] | None = None,
           prompt: list[list[int]] | None = None, output: list[list[int]] | None = None) -> SampleResult:
    rows = logits if logits.dim() == 2 else logits.expand(len(params), -1)
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return Sampler()(rows.clone(), list(params), gens, prompt or [[] for _ in params], output or [[] for _ in params])


def draws(params: SamplingParams, n: int = 300, logits: torch.Tensor = LOGITS) -> set[int]:
    """The set of tokens seen over ``n`` independent samples (one batch of ``n`` rows)."""
    return set(sample(logits, *([params] * n)).token_ids)


def test_greedy_picks_the_argmax() -> None:
    assert sample(LOGITS, SamplingParams(temperature=0)).token_ids == [ARGMAX]


def test_greedy_is_per_row_in_a_mixed_batch() -> None:
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    res = sample(rows, SamplingParams(temperature=0), SamplingParams(temperature=0))
    assert res.token_ids == [ARGMAX, V - 1 - ARGMAX]


def test_top_k_1_equals_greedy() -> None:
    assert draws(SamplingParams(temperature=1.0, top_k=1)) == {ARGMAX}


def test_tiny_top_p_equals_greedy() -> None:
    assert draws(SamplingParams(temperature=1.0, top_p=1e-6)) == {ARGMAX}


def test_top_k_keeps_only_the_k_most_likely() -> None:
    assert draws(SamplingParams(temperature=5.0, top_k=2)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # two equal leaders hold almost all the mass: top_p=0.5 keeps the first and the one needed to reach 0.5
    logits = torch.tensor([10.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert draws(SamplingParams(temperature=1.0, top_p=0.6), logits=logits) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.4), logits=logits) <= {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    probs = torch.softmax(LOGITS, -1)
    keep = {i for i in range(V) if probs[i] >= 0.3 * probs.max()}
    assert keep == {1, 3, 6}
    assert draws(SamplingParams(temperature=1.0, min_p=0.3), n=600) == keep


def test_unfiltered_sampling_reaches_more_than_the_argmax() -> None:
    assert len(draws(SamplingParams(temperature=1.0))) > 2


def test_the_same_seed_gives_the_same_tokens() -> None:
    p = SamplingParams(temperature=1.0)
    a = sample(LOGITS, *[p] * 20, seeds=list(range(20))).token_ids
    b = sample(LOGITS, *[p] * 20, seeds=list(range(20))).token_ids
    assert a == b


def test_different_seeds_give_different_tokens() -> None:
    p = SamplingParams(temperature=1.0)
    assert len(set(sample(LOGITS, *[p] * 40, seeds=list(range(40))).token_ids)) > 1


def test_a_seeded_row_is_unaffected_by_its_batch_neighbours() -> None:
    p = SamplingParams(temperature=1.0)
    alone = sample(LOGITS, p, seeds=[7]).token_ids
    with_others = sample(LOGITS, p, p, p, seeds=[1, 7, 3]).token_ids
    assert with_others[1] == alone[0]


# ---- penalties ---------------------------------------------------------------------------------------
def penalized(p: SamplingParams, prompt: list[int], output: list[int], logits: torch.Tensor = LOGITS) -> torch.Tensor:
    return Sampler._apply_penalties(logits.clone().unsqueeze(0), [p], [prompt], [output])[0]


def test_presence_penalty_subtracts_once_from_each_generated_token() -> None:
    out = penalized(SamplingParams(presence_penalty=0.5), prompt=[0], output=[1, 1, 3])
    expected = LOGITS.clone()
    expected[1] -= 0.5
    expected[3] -= 0.5
    assert torch.allclose(out, expected)


def test_frequency_penalty_subtracts_per_occurrence() -> None:
    out = penalized(SamplingParams(frequency_penalty=0.5), prompt=[0], output=[1, 1, 3])
    expected = LOGITS.clone()
    expected[1] -= 1.0
    expected[3] -= 0.5
    assert torch.allclose(out, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    out = penalized(SamplingParams(repetition_penalty=2.0), prompt=[4], output=[1])
    expected = LOGITS.clone()
    expected[1] = 3.0 / 2.0  # positive: divided
    expected[4] = -1.0 * 2.0  # negative (seen in the prompt): multiplied
    assert torch.allclose(out, expected)


def test_presence_and_frequency_penalties_ignore_prompt_tokens() -> None:
    out = penalized(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), prompt=[1, 3], output=[])
    assert torch.allclose(out, LOGITS)


def test_a_penalty_can_change_the_greedy_choice() -> None:
    res = sample(LOGITS, SamplingParams(temperature=0, presence_penalty=1.0), output=[[ARGMAX]])
    assert res.token_ids == [3]


def test_penalties_leave_rows_without_them_untouched() -> None:
    res = sample(LOGITS, SamplingParams(temperature=0, presence_penalty=2.0), SamplingParams(temperature=0),
                 output=[[ARGMAX], [ARGMAX]])
    assert res.token_ids == [3, ARGMAX]


# ---- logprobs ----------------------------------------------------------------------------------------
def test_no_logprobs_unless_asked() -> None:
    res = sample(LOGITS, SamplingParams(temperature=0))
    assert res.logprobs is None and res.top_logprobs is None


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    res = sample(LOGITS, SamplingParams(temperature=0, logprobs=0))
    assert res.logprobs == [pytest.approx(float(torch.log_softmax(LOGITS, -1)[ARGMAX]))]
    assert res.top_logprobs == [[]]


def test_logprobs_k_gives_the_k_most_likely_in_order() -> None:
    res = sample(LOGITS, SamplingParams(temperature=0, logprobs=3))
    top = res.top_logprobs[0]
    assert [t for t, _ in top] == [1, 3, 6]
    assert sum(math.exp(lp) for _, lp in top) < 1
    assert top[0][1] == pytest.approx(res.logprobs[0])


def test_each_row_gets_its_own_number_of_logprobs() -> None:
    res = sample(LOGITS, SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0, logprobs=4),
                 SamplingParams(temperature=0))
    assert [len(t) for t in res.top_logprobs] == [1, 4, 0]


def test_logprobs_come_from_the_raw_logits_not_the_penalized_ones() -> None:
    res = sample(LOGITS, SamplingParams(temperature=0, logprobs=1, presence_penalty=2.0), output=[[ARGMAX]])
    assert res.logprobs == [pytest.approx(float(torch.log_softmax(LOGITS, -1)[res.token_ids[0]]))]


# ---- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.1}, {"top_k": -2}, {"min_p": 1.5}, {"max_tokens": 0},
     {"n": 0}, {"n": 17}, {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
     {"logprobs": 21}, {"logprobs": -1}],
)
def test_out_of_range_params_raise_naming_the_parameter(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs))


def test_a_single_stop_string_becomes_a_list_and_empty_ones_are_dropped() -> None:
    assert SamplingParams(stop="x").stop == ["x"]  # type: ignore[arg-type]
    assert SamplingParams(stop=["", "y"]).stop == ["y"]
