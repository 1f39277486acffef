"""Queueing, the search, and the ranking."""

from __future__ import annotations

import math

from fleetllm.recommend.candidate import Candidate
from fleetllm.recommend.catalogue import load_catalogue
from fleetllm.recommend.model_shape import CATALOGUE
from fleetllm.recommend.queueing import erlang_c, predict
from fleetllm.recommend.search import rank, search, step_model
from fleetllm.recommend.workload import from_bench, from_distribution

CAT = load_catalogue()
SLOS = {"ttft_p90_ms": 3000, "itl_p99_ms": 400, "e2e_p90_s": 20}


def test_erlang_c_is_a_probability_that_grows_with_load() -> None:
    values = [erlang_c(8, a) for a in (1, 4, 6, 7.5)]
    assert all(0 <= v <= 1 for v in values) and values == sorted(values)


def test_latency_grows_with_traffic_until_the_replica_saturates() -> None:
    cpu = CAT.instance("local-cpu")
    c = Candidate(cpu, 1, CAT.formats["fp32"], 1, 16, 256)
    step = step_model(CATALOGUE["smollm2-135m"], cpu, c.fmt, 1, None)  # type: ignore[arg-type]
    w = from_distribution("isl=128,osl=32")
    preds = [predict(c, step, w, r, step.kv_capacity_tokens()) for r in (0.1, 0.3, 0.6, 5.0)]
    assert [p.ttft_p90_ms for p in preds[:3]] == sorted(p.ttft_p90_ms for p in preds[:3])
    assert preds[0].measured and not preds[-1].feasible and math.isinf(preds[-1].ttft_p90_ms)


def test_the_whole_catalogue_is_searched_over_ten_thousand_candidates() -> None:
    w = from_bench("synthetic", isl=128, osl=32)
    result = search(CATALOGUE["smollm2-135m"], w, 0.5, SLOS, CAT)
    assert result.considered >= 10_000 and result.predicted > 0
    ranked = rank(result, "cost", w, 0.5, SLOS)
    assert ranked[0].meets_slos and ranked[0].candidate.instance.local  # this machine is the cheapest here
    assert ranked[0].prediction.capacity_rps and ranked[0].prediction.capacity_rps >= 0.5


def test_a_model_that_fits_no_single_small_gpu_is_pruned_by_memory() -> None:
    w = from_bench("synthetic", isl=1024, osl=128)
    result = search(CATALOGUE["llama-3.1-70b"], w, 1.0, SLOS, CAT, instances=["g6.xlarge", "g5.xlarge"])
    assert result.predicted == 0 and result.pruned["memory fit"] == result.considered


def test_formats_beyond_the_quality_limit_are_never_candidates() -> None:
    w = from_bench("synthetic", isl=512, osl=64)
    strict = search(CATALOGUE["llama-3.1-8b"], w, 1.0, SLOS, CAT, instances=["g6e.xlarge"])
    assert {s.candidate.fmt.name for s in strict.scored} <= {"bf16", "fp8"}
    loose = search(CATALOGUE["llama-3.1-8b"], w, 1.0, SLOS, CAT, instances=["g6e.xlarge"], max_quality_loss=2.0)
    assert "int4" in {s.candidate.fmt.name for s in loose.scored}


def test_each_objective_ranks_the_candidates_meeting_the_slos_its_own_way() -> None:
    w = from_bench("synthetic", isl=128, osl=32)
    result = search(CATALOGUE["smollm2-135m"], w, 0.3, SLOS, CAT, instances=["local-cpu"])
    by_cost = [s for s in rank(result, "cost", w, 0.3, SLOS, headroom_for=0) if s.meets_slos]
    assert [s.candidate.price_per_hour for s in by_cost] == sorted(s.candidate.price_per_hour for s in by_cost)
    by_latency = [s for s in rank(result, "latency", w, 0.3, SLOS, headroom_for=0) if s.meets_slos]
    assert [s.prediction.e2e_p90_s for s in by_latency] == sorted(s.prediction.e2e_p90_s for s in by_latency)
    best = rank(result, "throughput", w, 0.3, SLOS, headroom_for=10)[0]
    assert best.meets_slos and best.prediction.capacity_rps
