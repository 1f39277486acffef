"""The suffix drafter's session streams, without a model: a turn drafts from the turns before it, memory stays bounded."""

from __future__ import annotations

import pytest

from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.sequence import Sequence, Status
from fleetllm.speculative import sessions
from fleetllm.speculative.drafter import create_drafter
from fleetllm.speculative.sessions import SPAN, SessionStreams

SYSTEM = list(range(1000, 1000 + 2 * SPAN))  # a system prompt two spans long
TOOL = list(range(2000, 2040))  # a tool output the reply will echo
REPLY = list(range(3000, 3030))  # what the first turn answered


def seq(rid: str, prompt: list[int], output: list[int] = ()) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(), max_tokens=64)
    s.output_token_ids = list(output)
    return s


def finish(drafter, s: Sequence) -> None:  # type: ignore[no-untyped-def]
    drafter.propose([s], [0])  # the engine drafts (or not) at every step of a running request
    s.status = Status.FINISHED_STOPPED
    drafter.forget(s)


def test_a_turn_drafts_the_earlier_turns_reply_its_prompt_no_longer_holds() -> None:
    d = create_drafter("suffix")
    finish(d, seq("t1", SYSTEM + [7, 8, 9], REPLY))
    # the agent resent the history without that reply (trimmed it); the new reply starts repeating it
    t2 = seq("t2", SYSTEM + [7, 8, 9, 5, 5], REPLY[:7])  # a match of 7 tokens earns 6 drafts
    assert d.propose([t2], [6]) == [REPLY[7:13]]


def test_without_session_memory_the_earlier_reply_is_not_drafted() -> None:
    d = create_drafter("suffix", session_tokens=0)
    finish(d, seq("t1", SYSTEM + [7, 8, 9], REPLY))
    assert d.propose([seq("t2", SYSTEM + [7, 8, 9, 5, 5], REPLY[:7])], [6]) == [[]]


def test_a_reply_echoing_a_tool_output_of_an_earlier_turn_drafts_the_echoed_span() -> None:
    d = create_drafter("suffix")
    t1_prompt = SYSTEM + TOOL + [7]
    finish(d, seq("t1", t1_prompt, REPLY))
    t2 = seq("t2", t1_prompt + REPLY + [4, 4, 4], TOOL[:9])
    assert d.propose([t2], [8]) == [TOOL[9:17]]
    assert d.sessions.live["t2"].tokens[: len(t1_prompt)] == t1_prompt  # the session's stream, continued


def test_a_prompt_that_does_not_extend_a_session_starts_its_own_stream() -> None:
    d = create_drafter("suffix")
    finish(d, seq("a", SYSTEM + TOOL, REPLY))
    b = seq("b", SYSTEM[:SPAN] + [9] * SPAN, REPLY[:3])  # shares one span, not the earlier request's prompt
    assert d.propose([b], [6]) == [[]]
    assert d.sessions.live["b"].tokens == b.all_token_ids


def test_two_live_requests_never_share_a_stream() -> None:
    d = create_drafter("suffix")
    finish(d, seq("t1", SYSTEM, REPLY))
    a, b = seq("a", SYSTEM + REPLY + [1]), seq("b", SYSTEM + REPLY + [2])
    d.propose([a, b], [2, 2])
    assert d.sessions.live["a"] is not d.sessions.live["b"]


def test_kept_sessions_stay_within_the_token_budget_least_recently_used_first() -> None:
    store = SessionStreams(max_tokens=5 * SPAN)
    for i in range(4):
        prompt = [i] * (2 * SPAN)
        store.stream_for(f"s{i}", prompt).sync(prompt)
        store.release(f"s{i}", prompt, len(prompt))
    assert store.tokens <= 5 * SPAN
    assert store.stream_for("next0", [0] * (3 * SPAN)).mirrored == 0  # s0 was dropped: a new stream
    assert store.stream_for("next3", [3] * (3 * SPAN)).mirrored == 2 * SPAN  # s3 kept: continued


def test_an_idle_session_is_freed_after_the_idle_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStreams()
    prompt = [1] * (2 * SPAN)
    store.stream_for("a", prompt).sync(prompt)
    store.release("a", prompt, len(prompt))
    assert store.tokens == 2 * SPAN
    monkeypatch.setattr(sessions, "IDLE_SECONDS", -1.0)
    store.stream_for("b", [2] * SPAN)
    assert store.tokens == 0 and not store.idle


def test_a_long_session_keeps_only_its_recent_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions, "MAX_STREAM", 4 * SPAN)
    store = SessionStreams()
    tokens = list(range(5 * SPAN))
    stream = store.stream_for("a", tokens)
    stream.sync(tokens)
    assert stream.tokens == tokens[-2 * SPAN :]
    stream.sync(tokens + [1, 2])  # the request's new tokens keep coming after the cut
    assert stream.tokens[-3:] == [tokens[-1], 1, 2]


def test_a_finished_request_leaves_no_live_stream() -> None:
    d = create_drafter("suffix")
    finish(d, seq("gone", SYSTEM, REPLY))
    assert not d.sessions.live
