"""Agent sessions: per-user speed, per-turn latency and cache hits, and the most sessions at a speed floor.

A *user* is a session (one agent loop). Its output speed is its decode rate over its whole session,
``Σ (N_out − 1) / Σ (t_end − t_1)`` over its successful turns (time between turns, the think time and
each turn's TTFT, is not decode time); a turn's speed is ``(N_out − 1) / (t_end − t_1)``, reported as p10 and
p50 over every turn of the load point. A load point meets the floor when every user that decoded at all has
a median turn speed at or above ``floor_tps`` and no request failed. ``floor_search`` finds the largest number of
concurrent sessions that meets it: double from ``start`` until a point fails, then bisect between the
last passing and the first failing point (it assumes, like the SLO search, that passing is monotone
in load).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from fleetllm.bench.client import RequestRecord


def user_tps(records: list[RequestRecord]) -> dict[str, float]:
    """Each session's output tokens per second while decoding (sessions with no decode time left out)."""
    tokens: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    for r in records:
        if r.ok and r.chunk_ns and (r.output_tokens or 0) >= 2 and r.end_ns > r.chunk_ns[0]:
            tokens[r.session_id] += r.output_tokens - 1
            seconds[r.session_id] += (r.end_ns - r.chunk_ns[0]) / 1e9
    return {s: tokens[s] / seconds[s] for s in tokens if seconds[s] > 0}


def turn_tps(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Each session's per-turn speeds: a turn's ``(N_out - 1) / (t_end - t_1)`` (turns of 2 tokens or more)."""
    out: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.ok and r.chunk_ns and (r.output_tokens or 0) >= 2 and r.end_ns > r.chunk_ns[0]:
            out[r.session_id].append((r.output_tokens - 1) / ((r.end_ns - r.chunk_ns[0]) / 1e9))
    return dict(out)


def by_turn(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Per turn index: requests, TTFT p50/p90 (ms), prompt tokens (mean) and the prefix-cache hit rate
    (Σ cached / Σ prompt tokens, from the server's ``usage.prompt_tokens_details.cached_tokens``)."""
    turns: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.ok and r.chunk_ns:
            turns[r.turn].append(r)
    out = []
    for t in sorted(turns):
        rs = turns[t]
        ttft = [(r.chunk_ns[0] - r.start_ns) / 1e6 for r in rs]
        prompt = [r.input_tokens for r in rs if r.input_tokens]
        known = [r for r in rs if r.input_tokens and r.cached_tokens is not None]
        hit = sum(r.cached_tokens for r in known) / sum(r.input_tokens for r in known) if known else None
        out.append({"turn": t, "requests": len(rs), "ttft_p50_ms": float(np.percentile(ttft, 50)),
                    "ttft_p90_ms": float(np.percentile(ttft, 90)),
                    "prompt_tokens_mean": float(np.mean(prompt)) if prompt else None, "cache_hit_rate": hit})
    return out


def agent_summary(records: list[RequestRecord], floor_tps: float | None) -> dict[str, Any]:
    """The agent view of one load point (see the module's docstring)."""
    tps = sorted(user_tps(records).values())
    turns = turn_tps(records)
    medians = [float(np.median(v)) for v in turns.values()]
    every = [v for vs in turns.values() for v in vs]
    failed = sum(1 for r in records if not r.ok and not r.cancelled)
    pct = (lambda q: float(np.percentile(tps, q))) if tps else (lambda q: None)
    summary: dict[str, Any] = {
        "users": len(tps), "failed_requests": failed,
        "user_tps": {"p10": pct(10), "p50": pct(50), "min": tps[0] if tps else None},
        "turn_tps": {"p10": float(np.percentile(every, 10)) if every else None,
                     "p50": float(np.percentile(every, 50)) if every else None,
                     "user_median_min": min(medians) if medians else None},
        "by_turn": by_turn(records), "floor_tps": floor_tps,
    }
    if floor_tps is not None:
        summary["users_below_floor"] = sum(1 for v in medians if v < floor_tps)
        summary["floor_met"] = bool(tps) and failed == 0 and summary["users_below_floor"] == 0
    return summary


def floor_search(passes: Callable[[int], bool], start: int = 1, max_sessions: int = 64) -> dict[str, Any]:
    """The most concurrent sessions for which ``passes(n)`` holds: doubling, then bisection.

    Returns ``best`` (None when even ``start`` fails), ``first_failing`` (None when ``max_sessions``
    passed) and every probed point in order."""
    points: list[dict[str, Any]] = []

    def probe(n: int) -> bool:
        ok = bool(passes(n))
        points.append({"sessions": n, "passed": ok})
        return ok

    lo: int | None = None
    hi: int | None = None
    n = max(1, start)
    while n <= max_sessions:
        if not probe(n):
            hi = n
            break
        lo = n
        if n == max_sessions:
            break
        n = min(n * 2, max_sessions)
    if lo is not None and hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return {"best": lo, "first_failing": hi, "points": points}
