"""Each routing policy's choice on constructed worker states (no HTTP)."""

from __future__ import annotations

import collections

import pytest

from fleetllm.router.index import PrefixIndex
from fleetllm.router.policies import (
    CostModel,
    LeastLoad,
    PrefixAware,
    RoundRobin,
    RouteRequest,
    Session,
    make_policy,
)
from fleetllm.router.upstream import WorkerMonitor, WorkerState


def workers(n: int) -> list[WorkerState]:
    return [WorkerState(f"w{i}", f"http://w{i}", healthy=True) for i in range(n)]


def test_round_robin_cycles_over_workers():
    ws = workers(3)
    p = RoundRobin()
    assert [p.choose(RouteRequest(), ws).worker.name for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_load_picks_fewest_in_flight_then_fewest_queued_prefill_tokens():
    ws = workers(3)
    ws[0].inflight, ws[1].inflight, ws[2].inflight = 3, 1, 1
    ws[1].pending_prefill_tokens, ws[2].pending_prefill_tokens = 500, 10
    d = LeastLoad(seed=0).choose(RouteRequest(), ws)
    assert (d.worker.name, d.reason) == ("w2", "balance")


def test_session_sticks_to_one_worker_per_key_and_spreads_keys():
    ws = workers(4)
    p = Session(seed=0)
    owners = {k: p.choose(RouteRequest(session_key=k), ws).worker.name for k in map(str, range(200))}
    assert all(p.choose(RouteRequest(session_key=k), ws).worker.name == w for k, w in owners.items())
    counts = collections.Counter(owners.values())
    assert len(counts) == 4 and min(counts.values()) > 20


def test_session_spills_when_the_owner_exceeds_the_load_bound():
    ws = workers(4)
    p = Session(c=1.25, seed=0)
    owner = p.choose(RouteRequest(session_key="alice"), ws)
    assert owner.reason == "affinity"
    owner.worker.inflight = 10  # far above 1.25 x mean
    d = p.choose(RouteRequest(session_key="alice"), ws)
    assert d.worker is not owner.worker and d.reason == "spill"


def test_session_removing_a_worker_moves_only_its_sessions():
    ws = workers(4)
    p = Session(seed=0)
    before = {k: p.choose(RouteRequest(session_key=k), ws).worker.name for k in map(str, range(300))}
    after = {k: p.choose(RouteRequest(session_key=k), ws[:3]).worker.name for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "w3" for k in moved)


def test_session_without_a_key_falls_back_to_least_load():
    ws = workers(2)
    ws[0].inflight = 5
    d = Session(seed=0).choose(RouteRequest(), ws)
    assert (d.worker.name, d.reason) == ("w1", "fallback")


def _req(hashes: list[int], bs: int = 16) -> RouteRequest:
    return RouteRequest(num_prompt_tokens=len(hashes) * bs + 5, block_hashes=hashes, block_size=bs)


def test_prefix_prefers_the_worker_holding_the_longest_prefix():
    idx = PrefixIndex(routed_ttl_s=300)
    ws = workers(3)
    idx.record_routed("w1", [1, 2, 3])
    idx.record_routed("w2", [1])
    d = PrefixAware("prefix", idx, seed=0).choose(_req([1, 2, 3, 4]), ws)
    assert (d.worker.name, d.reason, d.cached_tokens) == ("w1", "affinity", 48)


def test_prefix_with_no_cached_blocks_anywhere_routes_cold_by_load():
    idx = PrefixIndex(routed_ttl_s=300)
    ws = workers(3)
    ws[0].pending_prefill_tokens, ws[1].pending_prefill_tokens = 4000, 2000
    d = PrefixAware("prefix", idx, seed=0).choose(_req([7, 8]), ws)
    assert (d.worker.name, d.reason) == ("w2", "cold")


def test_prefix_spills_a_hot_prefix_when_the_affine_worker_is_swamped():
    idx = PrefixIndex(routed_ttl_s=300)
    ws = workers(2)
    idx.record_routed("w0", [1, 2])
    ws[0].pending_prefill_tokens = 50_000  # 50 s of queued prefill at 1000 tok/s
    d = PrefixAware("prefix", idx, CostModel(prefill_tokens_per_s=1000), seed=0).choose(_req([1, 2, 3]), ws)
    assert (d.worker.name, d.reason) == ("w1", "spill")


def test_kv_pressure_penalises_a_nearly_full_worker():
    ws = workers(2)
    ws[0].kv_usage = 0.99
    cost = CostModel()
    assert cost.cost(ws[0], 100) > cost.cost(ws[1], 100) + 1.0


def test_kv_aware_follows_the_workers_events_through_evictions():
    idx = PrefixIndex(routed_ttl_s=0)  # exact only
    ws = workers(2)
    p = make_policy("kv_aware", idx, seed=0)
    idx.reset("w1", [10, 11, 12], capacity=100)
    assert p.choose(_req([10, 11, 12]), ws).worker.name == "w1"
    idx.removed("w1", [10])  # the first block was evicted: nothing of the prefix is reusable
    d = p.choose(_req([10, 11, 12]), ws)
    assert d.reason == "cold" and d.cached_tokens == 0


def test_cached_estimate_never_exceeds_prompt_minus_one_token():
    idx = PrefixIndex(routed_ttl_s=300)
    ws = workers(1)
    idx.record_routed("w0", [1, 2])
    d = PrefixAware("prefix", idx).choose(RouteRequest(num_prompt_tokens=32, block_hashes=[1, 2], block_size=16), ws)
    assert d.cached_tokens == 31


def test_unknown_policy_name_is_a_clear_error():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest", PrefixIndex(1.0))


def test_prefix_aware_never_piles_onto_a_worker_far_above_the_mean_load():
    idx = PrefixIndex(routed_ttl_s=300)
    ws = workers(4)
    idx.record_routed("w0", [1, 2, 3])
    ws[0].inflight = 6  # the others are idle: 6 + 1 > ceil(1.25 * 7 / 4)
    d = make_policy("kv_aware", idx, CostModel(prefill_tokens_per_s=1e9), seed=0).choose(_req([1, 2, 3]), ws)
    assert d.worker.name != "w0" and d.reason == "spill"


# Saturation (issue 13 item 5): a worker's queue is part of its cost, whoever filled it.
_SYSTEM = list(range(100, 164))  # a hot 1024-token system prompt: 64 blocks of 16 tokens


def _holder_and_cold(waiting: int, queued_tokens: int) -> list[WorkerState]:
    """w0 holds the system prompt and reports a queue (filled by another router: this one's counts are zero);
    w1 is idle and holds nothing."""
    ws = workers(2)
    ws[0].waiting, ws[0].queued_prefill_tokens = waiting, queued_tokens
    return ws


def _choose_new_session(ws: list[WorkerState]):
    idx = PrefixIndex(routed_ttl_s=0)
    idx.reset("w0", _SYSTEM, capacity=1000)
    policy = make_policy("kv_aware", idx, CostModel(prefill_tokens_per_s=1000, decode_tokens_per_s=50), seed=0)
    return policy.choose(_req([*_SYSTEM, 999]), ws)


def test_kv_aware_spills_a_new_session_when_the_holders_queue_costs_more_than_recomputing_the_prefix():
    # 3 s of queued prefill on w0 against 1.024 s to recompute the system prompt on w1: replicate it
    d = _choose_new_session(_holder_and_cold(waiting=3, queued_tokens=3000))
    assert (d.worker.name, d.reason, d.cached_tokens) == ("w1", "spill", 0)


def test_kv_aware_spills_on_waiting_requests_alone():
    # a worker that reports waiting requests but no token count (an older worker) still has a queue
    d = _choose_new_session(_holder_and_cold(waiting=60, queued_tokens=0))
    assert (d.worker.name, d.reason) == ("w1", "spill")


def test_kv_aware_stays_on_the_holder_while_its_queue_is_shorter_than_recomputing():
    d = _choose_new_session(_holder_and_cold(waiting=1, queued_tokens=300))
    assert (d.worker.name, d.reason, d.cached_tokens) == ("w0", "affinity", 1024)


def test_router_and_worker_counts_of_one_queue_are_not_added_twice():
    # the router's own pending tokens and the worker's report describe the same requests: the larger counts
    w = workers(1)[0]
    w.pending_prefill_tokens, w.queued_prefill_tokens = 2000, 1500
    assert CostModel(prefill_tokens_per_s=1000, decode_tokens_per_s=1e9).queue_s(w) == pytest.approx(2.0)


def test_the_workers_load_events_carry_its_queued_prefill_tokens():
    w = workers(1)[0]
    WorkerMonitor([w], PrefixIndex(1.0), client=None)._apply(  # type: ignore[arg-type]
        w, {"type": "load", "running": 4, "waiting": 2, "kv_usage": 0.5, "queued_prefill_tokens": 700})
    assert (w.running, w.waiting, w.queued_prefill_tokens) == (4, 2, 700)


def test_kv_aware_keeps_a_returning_session_on_the_worker_holding_its_history_past_the_load_bound():
    idx = PrefixIndex(routed_ttl_s=0)
    ws = workers(2)
    idx.reset("w0", [1, 2, 3], capacity=100)
    idx.stored("w0", [4], medium="CPU")  # the rest of its history, evicted into the worker's host tier
    ws[0].inflight = 3  # its other sessions' turns: 3 + 1 > ceil(1.25 * 4 / 2)
    req = _req([1, 2, 3, 4, 5])
    p = make_policy("kv_aware", idx, CostModel(prefill_tokens_per_s=1000, decode_tokens_per_s=500), seed=0)
    assert p.choose(req, ws).worker.name == "w1"  # no session: bounded, as a hot prefix is
    req.session_key = "agent-7"
    assert p.choose(req, ws).worker.name == "w0"  # its own 4 of 5 blocks: the cost model weighs the queue
