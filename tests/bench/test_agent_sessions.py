"""Agent sessions in `fleetllm bench`: the workload, the per-user view of a run, and the floor search."""

from __future__ import annotations

import json
from pathlib import Path

from fleetllm.bench.agent import agent_summary, floor_search, user_tps
from fleetllm.bench.cli import main
from fleetllm.bench.client import RequestRecord
from fleetllm.bench.workloads import AgenticWorkload, PromptBuilder

AGENT = AgenticWorkload(PromptBuilder(), context_len=50, turns=40, step_len=100, step_len_max=400, osl=8,
                        think_time_s=0.5, system_len=300, max_context=2000)


def sessions(seed: int, n: int) -> list:
    it = AGENT.sessions(seed)
    return [next(it) for _ in range(n)]


# ---- the workload -------------------------------------------------------------------------------------
def test_every_session_of_every_seed_starts_with_the_same_system_prompt_and_tool_schema():
    shared = AGENT.shared_system()
    assert '"name": "read_file"' in shared and '"name": "run_tests"' in shared
    for s in sessions(1, 3) + sessions(2, 3):
        assert s.system.startswith(shared + "\n\n") and s.system != shared + "\n\n"
        assert s.system_tokens == 350


def test_turns_append_tool_outputs_until_the_context_limit():
    for s in sessions(3, 5):
        steps = [t.input_tokens for t in s.turns]
        assert all(100 <= n <= 400 for n in steps) and len(set(steps)) > 1
        assert 350 + sum(n + 8 for n in steps) <= 2000 < 350 + sum(n + 8 for n in steps) + 400 + 8 or len(steps) == 40
        assert [t.think_time_s for t in s.turns] == [0.0] + [0.5] * (len(s.turns) - 1)
        assert all(t.content.startswith(f"tool result: call_{i} ") for i, t in enumerate(s.turns))


def test_without_agent_flags_a_session_is_its_own_code_context():
    s = next(AgenticWorkload(PromptBuilder(), context_len=30, turns=3, step_len=5).sessions(0))
    assert len(s.system.split()) == 30 and len(s.turns) == 3


# ---- the per-user view --------------------------------------------------------------------------------
def rec(session: str, turn: int, first_ms: float, end_ms: float, out: int, prompt: int = 100, cached: int = 0,
        error: str | None = None) -> RequestRecord:
    ns = 1_000_000
    return RequestRecord(0, session, turn, out, None, 0, 0, end_ns=int(end_ms * ns), chunk_ns=[int(first_ms * ns)],
                         input_tokens=prompt, output_tokens=out, cached_tokens=cached, error=error)


def test_a_users_speed_is_its_decode_rate_over_all_its_turns():
    records = [rec("a", 0, 100, 1100, 11), rec("a", 1, 5000, 6000, 21), rec("b", 0, 50, 550, 6)]
    assert user_tps(records) == {"a": 30 / 2.0, "b": 5 / 0.5}


def test_the_floor_holds_only_when_every_user_and_every_request_is_fine():
    records = [rec("a", 0, 100, 1100, 11), rec("b", 0, 100, 1100, 31)]
    assert agent_summary(records, 10.0)["floor_met"]
    s = agent_summary(records, 20.0)
    assert not s["floor_met"] and s["users_below_floor"] == 1 and s["user_tps"]["min"] == 10.0
    assert not agent_summary([*records, rec("c", 0, 1, 2, 4, error="http_500")], 10.0)["floor_met"]


def test_turns_report_ttft_and_the_servers_cache_hit_rate():
    records = [rec("a", 0, 200, 900, 5, 100, 0), rec("a", 1, 50, 900, 5, 300, 240), rec("b", 1, 150, 900, 5, 100, 60)]
    t0, t1 = agent_summary(records, None)["by_turn"]
    assert (t0["turn"], t0["cache_hit_rate"], t0["ttft_p50_ms"]) == (0, 0.0, 200.0)
    assert (t1["requests"], t1["cache_hit_rate"], t1["ttft_p50_ms"]) == (2, 0.75, 100.0)


# ---- the floor search ---------------------------------------------------------------------------------
def test_the_search_doubles_then_bisects_to_the_last_passing_count():
    r = floor_search(lambda n: n <= 5, start=1, max_sessions=64)
    assert (r["best"], r["first_failing"]) == (5, 6)
    assert [p["sessions"] for p in r["points"]] == [1, 2, 4, 8, 6, 5]


def test_the_search_reports_none_when_one_session_misses_and_stops_at_the_cap():
    assert floor_search(lambda n: False)["best"] is None
    r = floor_search(lambda n: True, start=3, max_sessions=10)
    assert (r["best"], r["first_failing"]) == (10, None) and [p["sessions"] for p in r["points"]] == [3, 6, 10]


def test_bench_cli_reports_agent_sessions_and_the_sessions_at_the_floor(fake, tmp_path: Path):
    out = tmp_path / "agent.json"
    assert main(["--url", fake.url, "--model", "fake", "--no-progress", "--output", str(out), "--workload", "agentic",
                 "--system-len", "40", "--context-len", "10", "--step-len", "5", "--step-len-max", "9", "--turns", "3",
                 "--osl", "4", "--concurrency", "2", "--requests", "6", "--floor-tps", "1", "--no-tokenize"]) == 0
    result = json.loads(out.read_text())
    agent = result["runs"][0]["agent"]
    assert agent["users"] == 2 and agent["floor_met"] and [t["turn"] for t in agent["by_turn"]] == [0, 1, 2]
    assert result["floor_sweep"] == {"floor_tps": 1.0, "best": 2}
