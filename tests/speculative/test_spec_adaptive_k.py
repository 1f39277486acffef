"""How adaptive K splits drafts over a batch: from each request's acceptance and what a step of so many
rows costs (costs are fed in: no timing here), backing off to no drafts and probing back."""

from __future__ import annotations

import math

from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.sequence import Sequence
from fleetllm.speculative.adaptive_k import MIN_GAIN, choose_ks
from fleetllm.speculative.config import SpeculativeConfig
from fleetllm.speculative.decoder import PROBE_BUDGET, PROBE_EVERY, PROBE_K, RequestSpecState, SpecDecoder
from fleetllm.speculative.step_cost import SHORT, StepCost


def rows_only(f):  # type: ignore[no-untyped-def]
    return lambda rows, verifying: f(rows)


def jump_at(bound: int, per_row: float, wide: float):  # type: ignore[no-untyped-def]
    """A step cost linear in rows below ``bound`` and ``wide`` times dearer from there (a kernel switch)."""
    return rows_only(lambda n: 1.0 + per_row * n * (1 if n < bound else wide))


def test_when_a_verify_costs_as_much_as_its_tokens_nobody_drafts() -> None:
    assert choose_ks([0.9], [4], rows_only(float)) == [0]


def test_when_a_verify_is_nearly_free_and_drafts_are_accepted_k_is_the_maximum() -> None:
    assert choose_ks([0.8], [4], rows_only(lambda n: 1.0 + 0.02 * n)) == [4]


def test_poor_acceptance_turns_speculation_off() -> None:
    assert choose_ks([0.1], [4], rows_only(lambda n: 1.0 + 0.2 * n)) == [0]


def test_a_thin_expected_gain_is_not_worth_speculating() -> None:
    free = rows_only(lambda n: 1.0)  # even with free verifies, 5% more tokens per step does not pay for the overheads
    assert (1 - 0.05**5) / (1 - 0.05) < MIN_GAIN
    assert choose_ks([0.05], [4], free) == [0]
    assert choose_ks([0.2], [4], free) != [0]  # 25% more tokens per step does


def test_larger_batches_get_fewer_drafts_each_when_steps_become_compute_bound() -> None:
    cost = rows_only(lambda n: max(1.0, n / 8))  # flat up to 8 rows, then linear
    per_request = [sum(choose_ks([0.7] * b, [8] * b, cost)) / b for b in (1, 4, 16)]
    assert per_request[0] > per_request[1] >= per_request[2] == 0


def test_drafts_go_to_the_requests_that_accept_them() -> None:
    rates = [0.9] * 4 + [0.2] * 12
    ks = choose_ks(rates, [4] * 16, rows_only(lambda n: 1.0 + 0.03 * n))
    assert all(k > 0 for k in ks[:4]) and ks[4:] == [0] * 12


def test_a_lone_drafting_request_is_judged_by_what_it_adds_to_the_batch() -> None:
    # Steps cost the same up to 32 rows: drafting one each doubles the rows of 16 requests for free, but a
    # single request drafting adds 4% to the batch's tokens, too little to pay speculation's own costs.
    cost = rows_only(lambda n: max(1.0, n / 32))
    assert sum(choose_ks([0.7] * 16, [1] * 16, cost)) == 16
    assert choose_ks([0.7] + [0.0] * 15, [1] * 16, cost) == [0] * 16


def test_the_drafts_stay_under_a_kernel_bound_when_crossing_it_costs_more_than_they_win() -> None:
    ks = choose_ks([0.7] * 16, [4] * 16, jump_at(48, 0.01, 2.0))
    assert 16 + sum(ks) < 48 and sum(ks) > 0


def test_the_drafts_cross_a_kernel_bound_when_the_step_beyond_is_cheap_enough() -> None:
    ks = choose_ks([0.7] * 16, [4] * 16, jump_at(48, 0.01, 1.02))
    assert 16 + sum(ks) >= 48


def test_a_fixed_cost_per_verifying_request_can_turn_speculation_off() -> None:
    rates, caps = [0.5] * 8, [2] * 8
    assert sum(choose_ks(rates, caps, lambda n, v: 1.0 + 0.01 * n)) > 0
    assert choose_ks(rates, caps, lambda n, v: 1.0 + 0.01 * n + 0.1 * v) == [0] * 8


def test_drafting_time_counts_against_the_drafts() -> None:
    cost = rows_only(lambda n: 1.0 + 0.02 * n)
    assert choose_ks([0.6], [4], cost) != [0]
    assert choose_ks([0.6], [4], cost, draft_seconds=lambda longest: 0.5 * longest) == [0]


def test_a_probe_gets_its_drafts_even_when_nothing_else_pays() -> None:
    assert choose_ks([0.1, 0.1], [4, 4], rows_only(float), floors=[2, 0]) == [2, 0]


def test_a_probe_is_cut_to_what_the_request_may_draft() -> None:
    assert choose_ks([0.1], [1], rows_only(float), floors=[2]) == [1]


def test_a_long_context_read_again_by_every_draft_turns_drafting_off() -> None:
    cheap_rows = rows_only(lambda n: 1.0 + 0.02 * n)
    assert choose_ks([0.7], [4], cheap_rows) == [4]
    assert choose_ks([0.7], [4], cheap_rows, context=lambda i, k: 1.0 + 1.5 * k) == [0]


def test_a_long_context_read_once_for_all_drafts_makes_drafting_pay() -> None:
    dear_rows = rows_only(lambda n: 0.5 + 0.5 * n)  # at a short context a draft row costs half a step
    assert choose_ks([0.6], [4], dear_rows) == [0]
    assert choose_ks([0.6], [4], dear_rows, context=lambda i, k: 10.0 + 0.1 * k) != [0]


def test_a_contexts_share_grows_with_its_length_and_is_nothing_when_short() -> None:
    cost = StepCost([1], [1.0], context=SHORT + 1000, context_extra=[0.1, 0.3])
    assert cost.context_seconds(0, SHORT + 500) == 0.05
    assert cost.context_seconds(1, SHORT + 2000) == 0.6
    assert cost.context_seconds(5, SHORT + 1000) == 0.3  # beyond the drafts measured: the last measure
    assert cost.context_seconds(1, SHORT) == 0.0
    assert StepCost([1], [1.0]).context_seconds(1, 8000) == 0.0  # not measured: nothing


def test_step_cost_jumps_where_it_was_measured_to() -> None:
    cost = StepCost([1, 16, 47, 48, 64], [1.0, 2.0, 4.0, 6.0, 7.0], per_verify=0.5)
    assert cost.rows(32) < 4.0 < cost.rows(48) == 6.0
    assert cost(48, 2) == 7.0
    assert cost.rows(128) == 14.0  # proportional beyond the last measure


def decoder_with(cost: StepCost) -> SpecDecoder:
    dec = SpecDecoder(SpeculativeConfig(method="ngram", k=4), loaded=None, runner=None)
    dec.cost = cost
    return dec


def test_a_request_whose_drafts_keep_failing_backs_off_then_probes() -> None:
    dec = decoder_with(StepCost([1, 8], [1.0, 1.1]))
    seq = Sequence("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(), max_tokens=64)
    seq.spec_state = RequestSpecState()
    assert dec.choose([seq], [4], [0], drafting=True) != [0]
    for _ in range(10):
        seq.spec_state.update(4, 0)
    ks = [dec.choose([seq], [4], dec._probes([seq], [4]), drafting=True)[0] for _ in range(PROBE_EVERY)]
    assert ks[:-1] == [0] * (PROBE_EVERY - 1)
    assert ks[-1] > 0  # a probe, so the request can win speculation back


def test_without_adaptive_k_every_request_drafts_its_maximum() -> None:
    dec = SpecDecoder(SpeculativeConfig(method="ngram", k=4, adaptive=False), loaded=None, runner=None)
    seq = Sequence("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(), max_tokens=64)
    assert dec.propose([seq], 1024) == {"r": [3, 1, 2]}


def test_probes_come_rarer_where_their_rows_are_dear() -> None:
    dec = decoder_with(StepCost([1, 8, 64], [1.0, 1.1, 8.0]))  # flat to 8 rows, then linear
    assert dec.probe_every(1) == PROBE_EVERY
    # at 16 rows a probe slows the step by ``share``; 16 requests probing every N steps take 16 * share / N
    share = (dec.cost.rows(16 + PROBE_K) - dec.cost.rows(16)) / dec.cost.rows(16)
    assert dec.probe_every(16) == math.ceil(16 * share / PROBE_BUDGET) > PROBE_EVERY
