"""Load modes and the streaming client against the in-test fake server (counts and structure only)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from fake_server import FakeServer, FakeState

from fleetllm.bench.client import COMPLETIONS, ClientConfig
from fleetllm.bench.load import LoadConfig, run_load
from fleetllm.bench.metrics import summarize
from fleetllm.bench.tokens import PROSE_WORDS, TokenCounter
from fleetllm.bench.workloads import (
    AgenticWorkload,
    MultiTurnWorkload,
    PromptBuilder,
    PromptFileWorkload,
    SharedPrefixWorkload,
    SyntheticWorkload,
    TraceWorkload,
)

SMALL = SyntheticWorkload(PromptBuilder(), isl_mean=8, osl_mean=5)


def client(server: FakeServer, **kw) -> ClientConfig:
    return ClientConfig(server.url, "fake", **kw)


def test_concurrency_mode_sends_exactly_the_requests_and_never_exceeds_the_users(fake):
    r = run_load(client(fake), LoadConfig(concurrency=3, max_requests=17), SMALL)
    assert len(r.records) == 17 and all(rec.ok for rec in r.records)
    assert len(fake.state.bodies) == 17
    assert fake.state.max_in_flight <= 3
    assert all(rec.output_tokens == 5 and rec.output_tokens_from_usage for rec in r.records)
    assert all(len(rec.chunk_ns) == 5 and rec.chunk_ns == sorted(rec.chunk_ns) for rec in r.records)


def test_requests_are_streamed_with_usage_requested(fake):
    run_load(client(fake), LoadConfig(concurrency=1, max_requests=1), SMALL)
    body = fake.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"][-1]["role"] == "user" and body["max_tokens"] == 5


def test_completions_endpoint_sends_a_prompt(fake):
    r = run_load(client(fake, endpoint=COMPLETIONS), LoadConfig(concurrency=2, max_requests=4), SMALL)
    assert all(rec.ok and rec.output_text.startswith("w0 ") for rec in r.records)
    assert all("prompt" in b and "messages" not in b for b in fake.state.bodies)


def test_warmup_requests_are_sent_but_kept_out_of_the_results(fake):
    r = run_load(client(fake), LoadConfig(concurrency=2, max_requests=6, warmup_requests=3), SMALL)
    assert len(fake.state.bodies) == 9
    assert len(r.warmup_records) == 3 and all(rec.warmup for rec in r.warmup_records)
    assert len(r.records) == 6 and not any(rec.warmup for rec in r.records)
    assert r.start_ns > max(rec.end_ns for rec in r.warmup_records)


@pytest.mark.parametrize("arrival,burstiness", [("constant", 1.0), ("poisson", 1.0), ("gamma", 0.3)])
def test_rate_modes_send_the_requested_count(fake, arrival, burstiness):
    load = LoadConfig(request_rate=200.0, arrival=arrival, burstiness=burstiness, max_requests=12, seed=1)
    r = run_load(client(fake), load, SMALL)
    assert len(r.records) == 12 and all(rec.ok for rec in r.records)


def test_rate_mode_with_concurrency_cap(fake):
    fake.state.token_delay_s = 0.01
    r = run_load(client(fake), LoadConfig(request_rate=1000.0, concurrency=2, max_requests=8), SMALL)
    assert len(r.records) == 8
    assert fake.state.max_in_flight <= 2


def test_constant_rate_schedules_arrivals_evenly(fake):
    r = run_load(client(fake), LoadConfig(request_rate=50.0, arrival="constant", max_requests=5), SMALL)
    offsets = sorted((rec.scheduled_ns - r.start_ns) / 1e9 for rec in r.records)
    assert offsets == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08], abs=2e-3)


def test_duration_limit_stops_issuing(fake):
    fake.state.token_delay_s = 0.01
    r = run_load(client(fake), LoadConfig(concurrency=2, duration_s=0.3), SMALL)
    assert 0 < len(r.records) < 100
    assert all(rec.start_ns < r.start_ns + int(0.3e9) for rec in r.records)


def test_ramp_up_delays_later_users(fake):
    fake.state.first_token_delay_s = 0.25  # longer than the ramp, so each user sends one request
    r = run_load(client(fake), LoadConfig(concurrency=4, max_requests=4, ramp_up_s=0.2), SMALL)
    starts = sorted(rec.start_ns - r.start_ns for rec in r.records)
    assert starts[-1] >= 0.15e9  # the 4th user starts 3/4 of the way into the ramp
    assert starts[0] < 0.05e9


def test_cancellation_ratio_aborts_streams_and_counts_them(fake):
    w = SyntheticWorkload(PromptBuilder(), isl_mean=8, osl_mean=40)
    fake.state.token_delay_s = 0.002
    r = run_load(client(fake), LoadConfig(concurrency=4, max_requests=30, cancel_ratio=0.5, seed=3), w)
    cancelled = [rec for rec in r.records if rec.cancelled]
    assert 5 <= len(cancelled) <= 25
    assert all(rec.error is None and len(rec.chunk_ns) < 40 for rec in cancelled)
    s = summarize(r.records, r.start_ns, r.end_ns)
    assert s["requests"]["cancelled"] == len(cancelled) and s["requests"]["errors"] == 0
    assert s["requests"]["completed"] == 30 - len(cancelled)
    deadline = time.monotonic() + 3
    while fake.state.aborted < len(cancelled) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.state.aborted == len(cancelled)  # the server saw each cancellation as a disconnect


def test_cap_on_requests_waiting_for_first_token(fake):
    fake.state.first_token_delay_s = 0.03
    r = run_load(client(fake), LoadConfig(request_rate=2000.0, max_requests=12, max_waiting_first_token=2), SMALL)
    assert len(r.records) == 12
    assert fake.state.max_waiting_first_token <= 2
    assert fake.state.max_in_flight >= 2


def test_multi_turn_sessions_resend_the_growing_history(fake):
    w = MultiTurnWorkload(PromptBuilder(), turns_mean=3, user_isl=6, osl=4, system_len=5)
    r = run_load(client(fake), LoadConfig(concurrency=1, max_requests=3), w)
    sizes = [len(b["messages"]) for b in fake.state.bodies]
    assert sizes == [2, 4, 6]  # system + (user, assistant)* + user
    first, third = fake.state.bodies[0]["messages"], fake.state.bodies[2]["messages"]
    assert third[:2] == first  # the history is resent verbatim
    assert third[2] == {"role": "assistant", "content": r.records[0].output_text}
    assert [rec.turn for rec in r.records] == [0, 1, 2]
    assert r.records[0].input_tokens < r.records[1].input_tokens < r.records[2].input_tokens


def test_agentic_sessions_grow_every_turn(fake):
    w = AgenticWorkload(PromptBuilder(), context_len=60, turns=4, step_len=10, osl=3)
    r = run_load(client(fake), LoadConfig(concurrency=2, max_requests=8), w)
    by_session: dict[str, list[int]] = {}
    for rec in sorted(r.records, key=lambda x: x.turn):
        by_session.setdefault(rec.session_id, []).append(rec.input_tokens)
    assert len(by_session) == 2
    for sizes in by_session.values():
        assert sizes == sorted(sizes) and sizes[-1] - sizes[0] >= 3 * 10


def test_shared_prefix_requests_share_system_prompts_on_the_wire(fake):
    w = SharedPrefixWorkload(PromptBuilder(), num_prefixes=2, prefix_len=20, suffix_len=5, osl=3)
    run_load(client(fake), LoadConfig(concurrency=2, max_requests=10), w)
    systems = {b["messages"][0]["content"] for b in fake.state.bodies}
    assert len(systems) == 2
    assert fake.state.prefix_hits > 0


def test_trace_replay_without_load_flags_follows_timestamps(fake, tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(f'{{"timestamp": {t}, "input_length": 5, "output_length": 3}}' for t in (0, 50, 100)))
    r = run_load(client(fake), LoadConfig(), TraceWorkload(path, PromptBuilder()))
    offsets = sorted((rec.scheduled_ns - r.start_ns) / 1e9 for rec in r.records)
    assert offsets == pytest.approx([0.0, 0.05, 0.1], abs=1e-3)


def test_errors_are_counted_by_kind_without_crashing_the_run(fake, tmp_path: Path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("fine one\nFAIL_500 please\nBREAK midway\nHANG forever\nfine two\n")
    r = run_load(client(fake, request_timeout_s=1.0), LoadConfig(concurrency=5, max_requests=5),
                 PromptFileWorkload(prompts, osl=5))
    s = summarize(r.records, r.start_ns, r.end_ns)
    assert s["requests"]["completed"] == 2
    assert s["errors_by_kind"] == {"http_500": 1, "stream_broken": 1, "timeout": 1}


def test_periodic_server_failures_are_counted(fake):
    fake.state.fail_every = 4
    r = run_load(client(fake), LoadConfig(concurrency=2, max_requests=12), SMALL)
    s = summarize(r.records, r.start_ns, r.end_ns)
    assert s["errors_by_kind"] == {"http_503": 3} and s["requests"]["completed"] == 9


def test_unreachable_server_is_a_connection_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = run_load(ClientConfig(f"http://127.0.0.1:{port}", "m"), LoadConfig(concurrency=1, max_requests=2), SMALL)
    assert [rec.error for rec in r.records] == ["connection", "connection"]


def test_without_usage_output_tokens_fall_back_to_chunks():
    with FakeServer(FakeState(include_usage=False, tokens_per_chunk=2)) as server:
        r = run_load(client(server), LoadConfig(concurrency=1, max_requests=2), SMALL)
    assert all(rec.output_tokens == 3 and not rec.output_tokens_from_usage for rec in r.records)


def test_token_counter_uses_tokenize_and_falls_back(fake):
    counter = TokenCounter(fake.url, "fake")
    assert counter.count("a b c") == 3 and counter.server_side is True
    assert counter.tokens_per_word(PROSE_WORDS) == pytest.approx(1.0)
    fake.state.tokenize = False
    fallback = TokenCounter(fake.url, "fake")
    assert fallback.count("a b") == 2 and fallback.server_side is False
