"""The routing cost to a request's finish: its expected output priced beside each worker's streams (no HTTP)."""

from __future__ import annotations

import time

import pytest

from fleetllm.router.index import PrefixIndex
from fleetllm.router.pipeline.held_average import TimeAverage
from fleetllm.router.pipeline.output_length import FIRST_GUESS, OutputLengths
from fleetllm.router.policies import CostModel, RouteRequest, make_policy
from fleetllm.router.upstream import WorkerState
from fleetllm.sim.profile import TimingProfile

SYSTEM = list(range(32))  # a shared system prompt's blocks (512 tokens)


def _fleet() -> tuple[list[WorkerState], PrefixIndex]:
    """Two workers; w0 holds the system prompt and runs one session's stream at 600 tokens of context."""
    idx = PrefixIndex(routed_ttl_s=0)
    ws = [WorkerState(f"w{i}", f"http://w{i}", healthy=True) for i in range(2)]
    idx.reset("w0", SYSTEM, capacity=1000)
    ws[0].inflight = ws[0].decoding = 1
    ws[0].inflight_tokens = 600
    return ws, idx


def _session_start(output_tokens: float) -> RouteRequest:
    return RouteRequest(num_prompt_tokens=SYSTEM[-1] * 16 + 40, block_hashes=[*SYSTEM, 999],
                        expected_output_tokens=output_tokens)


def test_a_long_answer_goes_where_it_decodes_alone_rather_than_where_its_system_prompt_is_cached():
    ws, idx = _fleet()
    policy = make_policy("kv_aware", idx, TimingProfile.default().cost_model(), seed=0)
    assert policy.choose(_session_start(1), ws).worker.name == "w0"  # a one-token answer: the cached prefix wins
    assert policy.choose(_session_start(150), ws).worker.name == "w1"  # 150 tokens beside another stream lose more


def test_the_decode_part_grows_with_the_streams_contexts_and_the_expected_output():
    ws, _ = _fleet()
    cost = CostModel(decode_tokens_per_s=500, decode_context_s=2e-6)
    short = cost.decode_s(ws[0], 10)
    assert short == pytest.approx(10 * (1 / 500 + 600 * 2e-6))
    ws[0].inflight_tokens = 6000
    assert cost.decode_s(ws[0], 10) > 2 * short and cost.decode_s(ws[0], 100) == pytest.approx(10 * cost.decode_s(ws[0], 10))
    assert cost.decode_s(ws[1], 100) == 0.0


def test_a_session_between_turns_still_counts_where_its_context_is_then_fades():
    w = WorkerState("w0", "http://w0", healthy=True)
    cost = CostModel(decode_tokens_per_s=500, load_window_s=5.0)
    t0 = time.monotonic()
    w.streams_avg.note(1, t0 - 20, 5.0)  # a stream ran from 20 s ago until 1 s ago
    w.streams_avg.note(0, t0 - 1, 5.0)
    between_turns = cost.decode_s(w, 100, now=t0)
    assert between_turns > 0.7 * 100 / 500
    assert cost.decode_s(w, 100, now=t0 + 30) < 0.01 * between_turns


def test_time_average_of_a_step_count():
    avg = TimeAverage()
    assert avg.at(5.0, 2.0) == 0.0
    avg.note(4, 0.0, 2.0)
    assert avg.at(0.0, 2.0) == 0.0 and avg.at(2.0, 2.0) == pytest.approx(4 * (1 - 1 / 2.718281828), rel=1e-6)
    assert avg.at(100.0, 2.0) == pytest.approx(4.0) and avg.at(100.0, 0.0) == 4.0


def test_expected_output_is_the_models_moving_average_capped_by_what_the_request_asks():
    lengths = OutputLengths()
    assert lengths.expected("m", {}) == FIRST_GUESS
    assert lengths.expected("m", {"max_tokens": 300}) == 300  # nothing seen yet: the cap
    for _ in range(50):
        lengths.observe("m", 120)
    assert lengths.expected("m", {}) == pytest.approx(120)
    assert lengths.expected("m", {"max_completion_tokens": 20}) == 20
    assert lengths.expected("m", {"max_tokens": True}) == pytest.approx(120)  # not a count: ignored
    assert lengths.expected("other", {}) == FIRST_GUESS  # per model


def test_a_returning_session_is_not_its_own_neighbour_where_its_history_is():
    idx = PrefixIndex(routed_ttl_s=0)
    ws = [WorkerState(f"w{i}", f"http://w{i}", healthy=True) for i in range(2)]
    history = list(range(100, 164))  # 1024 tokens: the session's previous turn, held by w0
    idx.reset("w0", history, capacity=1000)
    t = time.monotonic()
    ws[0].streams_avg.note(1, t - 3, 3.0)  # that turn ran there until a moment ago
    ws[0].streams_avg.note(0, t - 0.2, 3.0)
    ws[0].tokens_avg.note(1024, t - 3, 3.0)
    ws[0].tokens_avg.note(0, t - 0.2, 3.0)
    req = RouteRequest(num_prompt_tokens=1100, block_hashes=[*history, 7], expected_output_tokens=200)
    cost = CostModel(prefill_tokens_per_s=700, decode_tokens_per_s=500, decode_context_s=7e-6)
    assert cost.decode_s(ws[0], 200, own_history=1024, now=t) == 0.0
    assert cost.decode_s(ws[0], 200, now=t) > 1.0  # anyone else's request would see that turn's load
    assert make_policy("kv_aware", idx, cost, seed=0).choose(req, ws).worker.name == "w0"
