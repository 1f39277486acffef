"""The agent-mix workload: turns whose answers are in their context, JSON-held where agents hold them, sessions bounded."""

from __future__ import annotations

import json

from fleetllm.bench.agent_mix import AgentMixWorkload, tokens_of
from fleetllm.bench.client import ClientConfig, RequestSpec, build_body


def first_sessions(n: int, seed: int = 0, **kw: int) -> list:
    it = AgentMixWorkload(**kw).sessions(seed)
    return [next(it) for _ in range(n)]


def test_the_same_seed_gives_the_same_sessions() -> None:
    a, b = first_sessions(2, 3), first_sessions(2, 3)
    assert [[t.content for t in s.turns] for s in a] == [[t.content for t in s.turns] for s in b]


def test_an_edit_turn_holds_the_code_its_reply_repeats() -> None:
    turns = [t for s in first_sessions(4) for t in s.turns if t.content.startswith("Copy this code")]
    assert turns
    for t in turns:
        code = t.content.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert "def " in code and t.body is None
        assert t.max_tokens >= tokens_of(code)  # room to repeat it all


def test_quote_and_call_replies_are_held_to_a_json_schema() -> None:
    turns = [t for s in first_sessions(4) for t in s.turns if t.body]
    kinds = {t.body["response_format"]["json_schema"]["name"] for t in turns}
    assert kinds == {"failures", "tool_call"}
    quote = next(t for t in turns if t.body["response_format"]["json_schema"]["name"] == "failures")
    report = json.loads(quote.content.split(":\n", 1)[1].rsplit("\n", 1)[0])
    assert report["summary"]["total"] == len(report["tests"])


def test_a_session_stops_before_its_context_would_pass_the_limit() -> None:
    for s in first_sessions(3, max_context=3000):
        total = s.system_tokens + sum(t.input_tokens + t.max_tokens for t in s.turns)
        assert total <= 3000 and len(s.turns) >= 2


def test_a_turns_own_request_fields_reach_its_body() -> None:
    turn = next(t for s in first_sessions(2) for t in s.turns if t.body)
    body = build_body(ClientConfig("http://x", "m", ignore_eos=False), RequestSpec(max_tokens=8, prompt="p", body=turn.body))
    assert body["response_format"]["type"] == "json_schema" and "ignore_eos" not in body
