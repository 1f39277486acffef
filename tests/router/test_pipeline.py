"""The routing pipeline's stages alone (no HTTP): filters, the cost scorers and their weights, pickers, and the
fallback when a request lacks what a stage needs."""

from __future__ import annotations

import random

import pytest

from fleetllm.errors import UsageError
from fleetllm.router.index import PrefixIndex
from fleetllm.router.pipeline.cost import CostModel
from fleetllm.router.pipeline.filters import BoundedLoad, Role, Routable, ServesModel, Untried
from fleetllm.router.pipeline.pickers import LowestCostPicker
from fleetllm.router.pipeline.pipeline import Pipeline
from fleetllm.router.pipeline.scorers import (
    Candidates,
    DecodeScorer,
    KVPressureScorer,
    PrefixScorer,
    QueueScorer,
)
from fleetllm.router.policies import RouteRequest, make_policy, scorer_weights
from fleetllm.router.upstream import WorkerState


def workers(n: int, **kw) -> list[WorkerState]:
    return [WorkerState(f"w{i}", f"http://w{i}", healthy=True, **kw) for i in range(n)]


def names(ws: list[WorkerState]) -> list[str]:
    return [w.name for w in ws]


def test_the_model_filter_keeps_its_copies_and_unlabelled_workers_only_in_a_one_model_fleet():
    ws = workers(3)
    ws[0].model, ws[1].model = "a", "b"
    assert names(ServesModel("a", one_model=False).apply(None, ws)) == ["w0"]
    assert names(ServesModel("a", one_model=True).apply(None, ws)) == ["w0", "w2"]
    assert ServesModel(None, one_model=False).apply(None, ws) == ws


def test_the_role_filter_leaves_prefill_workers_to_the_pd_stage():
    ws = workers(3)
    ws[0].role, ws[1].role = "prefill", "decode"
    assert names(Role().apply(None, ws)) == ["w1", "w2"]


def test_health_breaker_draining_and_tried_workers_are_filtered_out():
    ws = workers(4)
    ws[0].healthy, ws[1].draining = False, True
    ws[2].breaker.failure(0.0), ws[2].breaker.failure(0.0), ws[2].breaker.failure(0.0)  # open
    assert names(Routable(1.0).apply(None, ws)) == ["w3"]
    assert names(Untried({"w3"}).apply(None, ws[2:])) == ["w2"]


def test_bounded_load_drops_workers_above_the_bound_but_never_all():
    ws = workers(4)
    ws[0].inflight = 6  # ceil(1.25 * 7 / 4) = 3: w0 would have 7
    assert names(BoundedLoad(1.25).apply(None, ws)) == ["w1", "w2", "w3"]
    assert BoundedLoad(1.25).apply(None, ws[:1]) == ws[:1]


def test_the_four_cost_scorers_add_up_to_the_cost_model():
    cost = CostModel(prefill_tokens_per_s=1000, decode_tokens_per_s=50)
    idx = PrefixIndex(routed_ttl_s=300)
    ws = workers(2, block_size=16)
    ws[0].pending_prefill_tokens, ws[0].decoding, ws[0].inflight, ws[0].kv_usage = 500, 2, 3, 0.9
    idx.record_routed("w1", [1, 2])
    req = RouteRequest(num_prompt_tokens=64, block_hashes=[1, 2, 3, 4], block_size=16)
    c = Candidates.to_score(req, ws, ws)
    for s in (QueueScorer(cost), PrefixScorer(idx, cost), DecodeScorer(cost), KVPressureScorer(cost)):
        s.score(c)
    assert c.cost == [cost.cost(ws[0], 64), cost.cost(ws[1], 32)]
    assert c.cached == [0, 32] and c.depth == {"w0": 0, "w1": 2}


def test_a_zero_prefix_weight_routes_by_load_alone():
    idx = PrefixIndex(routed_ttl_s=300)
    ws = workers(2)
    idx.record_routed("w0", list(range(8)))
    ws[0].pending_prefill_tokens = 100  # a little queue on the holder
    req = RouteRequest(num_prompt_tokens=8 * 16 + 4, block_hashes=list(range(8)))
    assert make_policy("kv_aware", idx, seed=0).choose(req, ws).worker.name == "w0"
    d = make_policy("kv_aware", idx, seed=0, weights={"prefix": 0.0}).choose(req, ws)
    assert (d.worker.name, d.reason) == ("w1", "spill")


def test_a_pipeline_whose_stage_lacks_what_it_needs_falls_back_to_the_least_loaded_worker():
    ws = workers(2)
    ws[0].inflight = 2
    p = Pipeline("p", LowestCostPicker(), requires=lambda r: r.session_key is not None, seed=0)
    d = p.choose(RouteRequest(), ws)
    assert (d.worker.name, d.reason) == ("w1", "fallback")


@pytest.mark.parametrize(("urgent", "policy", "chosen"), [(True, "priority", "w0"), (False, "priority", "w1"),
                                                        (True, "fcfs", "w1")])
def test_least_load_leaves_out_the_bulk_requests_an_urgent_one_would_displace(urgent, policy, chosen):
    # w0: five in flight, four of them this router's bulk requests; w1: three interactive streams
    ws = workers(2, scheduling_policy=policy)
    ws[0].inflight, ws[0].bulk_inflight, ws[1].inflight = 5, 4, 3
    d = make_policy("least_load", PrefixIndex(60.0), seed=0).choose(RouteRequest(urgent=urgent), ws)
    assert d.worker.name == chosen


def test_the_lowest_cost_picker_breaks_ties_at_random_among_the_cheapest_only():
    ws = workers(3)
    c = Candidates(RouteRequest(), ws, ws, [1.0, 1.0, 2.0], [0, 0, 0])
    picked = {LowestCostPicker().pick(c, random.Random(s)).worker.name for s in range(20)}
    assert picked == {"w0", "w1"}


def test_a_policys_stages_are_named_for_the_router_state():
    assert make_policy("kv_aware", PrefixIndex(1.0), weights={"queue": 2.0}).stages() == {
        "filters": ["bounded_load"], "picker": "lowest_cost",
        "scorers": {"queue": 2.0, "prefix": 1.0, "decode": 1.0, "kv_pressure": 1.0, "lora": 1.0}}
    assert make_policy("session", PrefixIndex(1.0)).stages() == {"filters": [], "scorers": {}, "picker": "session"}


@pytest.mark.parametrize("given", [{"latency": "1"}, {"prefix": "-1"}, {"queue": "x"}, {"decode": "inf"}])
def test_a_scorer_weight_must_name_a_scorer_and_be_a_finite_number_at_least_zero(given):
    with pytest.raises(UsageError, match="--scorer-weight"):
        scorer_weights(given)
