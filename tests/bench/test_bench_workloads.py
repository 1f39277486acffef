"""Workload generators: seeded reproducibility, real prefix sharing, growing sessions, file formats."""

from __future__ import annotations

import base64
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fleetllm.bench.load import arrival_gaps, ramped_time
from fleetllm.bench.workloads import (
    AgenticWorkload,
    MultiTurnWorkload,
    PromptBuilder,
    PromptFileWorkload,
    SharedPrefixWorkload,
    SyntheticWorkload,
    TraceWorkload,
    long_short_workload,
)

B = PromptBuilder()


def take(workload, seed: int, n: int):
    return list(itertools.islice(workload.sessions(seed), n))


@pytest.mark.parametrize("workload", [
    SyntheticWorkload(B, 64, 8, 16, 4),
    SyntheticWorkload(B, mix=[(32, 8, 0.5), (256, 4, 0.5)]),
    SharedPrefixWorkload(B, num_prefixes=4, prefix_len=50, suffix_len=10),
    MultiTurnWorkload(B, turns_mean=3, turns_std=1, user_isl=20),
    AgenticWorkload(B, context_len=100, turns=3, step_len=20),
    long_short_workload(B, long_isl=300, short_isl=30),
], ids=lambda w: w.name)
def test_same_seed_same_sessions_and_other_seed_differs(workload):
    assert take(workload, 7, 5) == take(workload, 7, 5)
    assert take(workload, 7, 5) != take(workload, 8, 5)


def test_synthetic_lengths_follow_isl_and_osl():
    sessions = take(SyntheticWorkload(B, isl_mean=40, osl_mean=12), 0, 20)
    assert all(len(s.turns[0].content.split()) == 40 and s.turns[0].max_tokens == 12 for s in sessions)


def test_builder_uses_measured_tokens_per_word():
    text = PromptBuilder(prose_tokens_per_word=2.0).text(np.random.default_rng(0), 100)
    assert len(text.split()) == 50


def test_mixed_and_long_short_streams_mix_in_proportion():
    sessions = take(long_short_workload(B, long_isl=300, short_isl=30, long_fraction=0.25), 1, 400)
    long = sum(1 for s in sessions if s.turns[0].input_tokens == 300)
    assert 60 < long < 140  # ~100 of 400
    assert {s.turns[0].input_tokens for s in sessions} == {30, 300}


def test_shared_prefixes_are_really_shared_with_zipf_popularity():
    w = SharedPrefixWorkload(B, num_prefixes=4, prefix_len=50, suffix_len=10, zipf_s=1.2)
    sessions = take(w, 3, 400)
    systems = Counter(s.system for s in sessions)
    assert len(systems) == 4  # exactly N distinct system prompts, each reused
    counts = sorted(systems.values(), reverse=True)
    assert counts[0] > 2 * counts[-1]  # skewed popularity
    assert len({s.turns[0].content for s in sessions}) == 400  # suffixes unique
    assert w.popularity()[0] == pytest.approx(1 / sum(1 / k**1.2 for k in range(1, 5)))


def test_multi_turn_sessions_have_turns_and_think_time():
    s = take(MultiTurnWorkload(B, turns_mean=5, user_isl=10, think_time_s=0.5), 0, 1)[0]
    assert len(s.turns) == 5
    assert [t.think_time_s for t in s.turns] == [0.0, 0.5, 0.5, 0.5, 0.5]


def test_agentic_sessions_start_from_a_long_code_context():
    s = take(AgenticWorkload(B, context_len=200, turns=6, step_len=30, osl=8), 0, 1)[0]
    assert s.system is not None and len(s.system.split()) == 200
    assert len(s.turns) == 6 and all(t.max_tokens == 8 for t in s.turns)
    assert all(t.content.startswith("tool result:") for t in s.turns)


def test_generic_trace_replays_timestamps_and_mooncake_hash_blocks(tmp_path: Path):
    rows = [{"timestamp": 1000, "input_length": 20, "output_length": 5, "hash_ids": [7]},
            {"timestamp": 1500, "input_length": 25, "output_length": 6, "hash_ids": [7, 8]},
            {"timestamp_s": 3.0, "prompt": "hello there", "max_tokens": 3}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sessions = list(TraceWorkload(path, B, speedup=2.0, block_tokens=10).sessions(0))
    assert [s.arrival_s for s in sessions] == pytest.approx([0.0, 0.25, 1.0])
    assert [s.turns[0].max_tokens for s in sessions] == [5, 6, 3]
    a, b = sessions[0].turns[0].content.split(), sessions[1].turns[0].content.split()
    assert a[:10] == b[:10]  # same hash id, same block text
    assert len(a) == 20 and len(b) == 25
    assert sessions[2].turns[0].content == "hello there"


def test_sagemaker_capture_lines_are_replayed(tmp_path: Path):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    out = {"usage": {"completion_tokens": 4}}
    lines = [
        {"captureData": {"endpointInput": {"observedContentType": "application/json", "mode": "INPUT",
                                           "data": base64.b64encode(json.dumps(body).encode()).decode(),
                                           "encoding": "BASE64"},
                         "endpointOutput": {"data": json.dumps(out), "encoding": "JSON", "mode": "OUTPUT"}},
         "eventMetadata": {"eventId": "a", "inferenceTime": "2026-01-01T00:00:00Z"}, "eventVersion": "0"},
        {"captureData": {"endpointInput": {"data": json.dumps({"inputs": "tgi prompt"}), "encoding": "JSON"},
                         "endpointOutput": {"data": json.dumps(out), "encoding": "JSON"}},
         "eventMetadata": {"eventId": "b", "inferenceTime": "2026-01-01T00:00:02.500Z"}, "eventVersion": "0"},
    ]
    path = tmp_path / "capture.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines))
    s1, s2 = TraceWorkload(path, B).sessions(0)
    assert s1.turns[0].messages == body["messages"] and s1.turns[0].max_tokens == 9
    assert s2.turns[0].content == "tgi prompt" and s2.turns[0].max_tokens == 4  # OSL from the captured usage
    assert s2.arrival_s == pytest.approx(2.5)


def test_prompt_file_text_and_jsonl(tmp_path: Path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [s.turns[0].content for s in PromptFileWorkload(txt, 5).sessions(0)] == ["first prompt", "second prompt"]
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "a", "max_tokens": 3}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "b"}]}))
    s1, s2 = PromptFileWorkload(jl, 5).sessions(0)
    assert (s1.turns[0].content, s1.turns[0].max_tokens) == ("a", 3)
    assert s2.turns[0].messages == [{"role": "user", "content": "b"}] and s2.turns[0].max_tokens == 5


@pytest.mark.parametrize("arrival,burstiness", [("constant", 1.0), ("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0)])
def test_arrival_gaps_have_mean_one_over_rate(arrival, burstiness):
    gaps = list(itertools.islice(arrival_gaps(np.random.default_rng(0), 20.0, arrival, burstiness), 20000))
    assert np.mean(gaps) == pytest.approx(0.05, rel=0.05)


def test_gamma_burstiness_below_one_is_burstier_than_poisson():
    cv = {k: np.std(g) / np.mean(g) for k in (0.25, 1.0, 4.0)
          for g in [list(itertools.islice(arrival_gaps(np.random.default_rng(1), 10.0, "gamma", k), 20000))]}
    assert cv[0.25] > cv[1.0] > cv[4.0]
    assert cv[1.0] == pytest.approx(1.0, rel=0.05)  # exponential gaps


def test_ramp_up_inverts_the_linear_intensity():
    # at full rate 1/s with a 10 s ramp: 5 arrivals-worth of time is spent ramping
    assert ramped_time(0.0, 10) == 0.0
    assert ramped_time(5.0, 10) == pytest.approx(10.0)
    assert ramped_time(6.0, 10) == pytest.approx(11.0)
    assert ramped_time(1.25, 10) == pytest.approx(5.0)
    assert ramped_time(3.0, 0) == 3.0


def test_multi_turn_sessions_can_share_a_few_system_prompts():
    wl = MultiTurnWorkload(B, turns_mean=2, system_len=64, shared_systems=3)
    it = wl.sessions(seed=7)
    systems = {next(it).system for _ in range(40)}
    assert len(systems) == 3
