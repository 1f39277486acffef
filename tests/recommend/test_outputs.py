"""The fleet simulation of the best candidates, the fleet YAML, and the command end to end."""

from __future__ import annotations

import json

import yaml

from fleetllm.cli import main
from fleetllm.fleet.config import FleetConfig
from fleetllm.recommend.candidate import Candidate
from fleetllm.recommend.catalogue import load_catalogue
from fleetllm.recommend.fleet_sim import simulate
from fleetllm.recommend.fleet_yaml import fleet_yaml
from fleetllm.recommend.model_shape import CATALOGUE
from fleetllm.recommend.report import pareto
from fleetllm.recommend.search import step_model
from fleetllm.recommend.speculation import Speculation
from fleetllm.recommend.workload import from_bench

CAT = load_catalogue()
CPU = CAT.instance("local-cpu")
SMOL = CATALOGUE["smollm2-135m"]


def cpu_candidate(**kw) -> Candidate:  # type: ignore[no-untyped-def]
    return Candidate(**{"instance": CPU, "tp": 1, "fmt": CAT.formats["fp32"], "replicas": 2, "max_batch": 8,
                        "chunk": 256, **kw})


def test_the_fleet_simulation_runs_the_real_prefix_cache_and_routing() -> None:
    w = from_bench("shared-prefix", isl=32, osl=8, prefix_len=256)
    step = step_model(SMOL, CPU, CAT.formats["fp32"], 1, None)  # type: ignore[arg-type]
    p = simulate(cpu_candidate(routing="kv_aware"), step, w, 0.5, step.kv_capacity_tokens(), requests=40)
    assert p is not None and p.queueing == "simulated" and p.measured
    assert p.extra["requests"] >= 30 and 0 < p.ttft_p50_ms <= p.ttft_p90_ms and p.itl_p50_ms > 0
    cold = simulate(cpu_candidate(routing="kv_aware"), step, from_bench("synthetic", isl=288, osl=8), 0.5,
                    step.kv_capacity_tokens(), requests=40)
    assert cold is not None and p.ttft_p50_ms < cold.ttft_p50_ms  # prefix hits: less to prefill


def test_the_simulated_router_weighs_prefix_hits_and_load_with_the_deployed_routers_rates() -> None:
    from fleetllm.cli import build_parser, router_config
    from fleetllm.recommend.fleet_sim import _Router

    deployed = router_config(build_parser("router").parse_args(["router"])).cost  # `fleetllm serve` passes no --profile
    assert _Router("kv_aware", []).cost == deployed


def test_a_sessions_next_turn_follows_its_answer_and_resends_the_history() -> None:
    from fleetllm.models.source import load_tokenizer
    from fleetllm.recommend.fleet_sim import make_requests

    w = from_bench("multi-turn", isl=48, osl=8, turns=3)
    reqs = make_requests(w, 1.0, 6, load_tokenizer("smollm2-135m")[0].vocab_size, arrivals=[0.0, 5.0])
    assert [r.arrival for r in reqs][::3] == [0.0, 5.0] and reqs[0].follow is reqs[1] and reqs[2].follow is None
    step = step_model(SMOL, CPU, CAT.formats["fp32"], 1, None)  # type: ignore[arg-type]
    aware = simulate(cpu_candidate(replicas=3, routing="kv_aware"), step, w, 1.0, step.kv_capacity_tokens(), requests=30)
    spread = simulate(cpu_candidate(replicas=3, routing="round_robin"), step, w, 1.0, step.kv_capacity_tokens(), requests=30)
    assert aware is not None and spread is not None and aware.extra["requests"] >= 27
    assert aware.ttft_p90_ms < spread.ttft_p90_ms  # the turn after an answer hits its history where it ran


def test_a_pd_split_prefills_long_prompts_on_the_prefill_pool_and_pays_the_transfer() -> None:
    step = step_model(SMOL, CPU, CAT.formats["fp32"], 1, None)  # type: ignore[arg-type]
    w = from_bench("long-short", isl=16, osl=8, long_isl=512, long_osl=8, long_fraction=0.5)
    kv = step.kv_capacity_tokens()
    alone = simulate(cpu_candidate(replicas=1), step, w, 0.8, kv, requests=30)
    split = simulate(cpu_candidate(replicas=1, prefill_replicas=1, pd_threshold=256), step, w, 0.8, kv, requests=30)
    assert split.extra["requests"] >= 27
    assert split.itl_p50_ms < alone.itl_p50_ms  # the decode replica no longer runs the long prefills


def test_a_copy_based_drafter_on_random_words_decodes_as_without_speculation() -> None:
    from dataclasses import replace

    ngram = Speculation("ngram", 4)
    assert ngram.verify_width("chat") == 5 and ngram.verify_width("random") == 1
    assert Speculation("eagle", 4).verify_width("random") == 5  # a model drafter always drafts
    step = step_model(SMOL, CPU, CAT.formats["fp32"], 1, None)  # type: ignore[arg-type]
    w = replace(from_bench("synthetic", isl=96, osl=24), category="random")

    def itl(spec: Speculation, w) -> float:  # type: ignore[no-untyped-def]
        return simulate(cpu_candidate(replicas=1, spec=spec), step, w, 0.5, step.kv_capacity_tokens(), requests=20,
                        seed=1, warmup=0).itl_p50_ms

    assert itl(ngram, w) == itl(Speculation(), w)
    assert itl(ngram, replace(w, category="chat")) != itl(Speculation(), w)  # on chat it drafts, 5 wide


def test_the_fleet_yaml_is_a_fleet_config_fleetllm_serve_reads(tmp_path) -> None:
    c = cpu_candidate(spec=Speculation("ngram", 4), routing="least_load")
    path = tmp_path / "fleet.yaml"
    path.write_text(fleet_yaml(c, SMOL))
    fleet = FleetConfig.from_yaml(path)
    assert fleet.policy == "least_load" and fleet.num_workers == 2
    assert fleet.models[0].worker_args() == ["--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                                             "--num-threads", "1", "--speculative", "method=ngram,k=4,adaptive=0"]


def test_a_pd_candidate_becomes_prefill_and_decode_entries(tmp_path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(fleet_yaml(cpu_candidate(prefill_replicas=1, pd_threshold=1024), SMOL))
    fleet = FleetConfig.from_yaml(path)
    assert [m.role for m in fleet.models] == ["prefill", "decode"] and fleet.pd_threshold == 1024


def test_the_pareto_front_keeps_only_undominated_points() -> None:
    points = [(1, 10), (2, 8), (1.5, 5), (3, 1), (0.5, 9)]
    assert sorted(pareto(points)) == [0, 1, 3]


def test_recommend_end_to_end_prints_json_and_writes_table_png_and_yaml(tmp_path, capsys) -> None:
    rc = main(["recommend", "--model", "smollm2-135m", "--workload", "isl=96:16,osl=16", "--traffic", "0.4",
               "--slo", "ttft_p90_ms=4000,itl_p99_ms=500,e2e_p90_s=20", "--instances", "local-cpu,g6.xlarge",
               "--simulate-top", "1", "--sim-requests", "40", "--json", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["ranked"][0]
    assert best["meets_slos"] and best["instance"] == "local-cpu" and best["queueing"] == "simulated"
    assert best["interval"]["ttft_p90_ms"][0] <= best["predicted"]["ttft_p90_ms"] <= best["interval"]["ttft_p90_ms"][1]
    assert doc["search"]["considered"] > 0 and doc["pareto_front"]
    assert (tmp_path / "pareto.png").stat().st_size > 1000
    assert FleetConfig.from_yaml(tmp_path / "fleet.yaml").models[0].source == "smollm2-135m"
    # the same choice as Kubernetes manifests: a worker Deployment of the chosen copies
    docs = [d for f in sorted((tmp_path / "kubernetes").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    workers = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and "smollm2" in d["metadata"]["name"]]
    assert doc["kubernetes"] and workers and workers[0]["spec"]["replicas"] == best["replicas"]


def test_validation_benches_the_same_workload_at_the_same_rate_and_slos(tmp_path) -> None:
    import argparse

    from fleetllm.bench.cli import add_bench_arguments
    from fleetllm.recommend.validate import bench_argv

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    w = from_bench("shared-prefix", isl=32, osl=16, prefix_len=256)
    args = parser.parse_args(bench_argv(w, "http://127.0.0.1:9", "smollm2-135m", 1.5, 20,
                                        {"ttft_p90_ms": 900, "e2e_p90_s": 4}, tmp_path / "b.json", 0))
    assert (args.workload, args.isl, args.osl, args.prefix_len) == ("shared-prefix", 32, 16, 256)
    assert (args.request_rate, args.requests, args.slo) == ("1.5", 20, "ttft_p90_ms=900,e2e_p90_ms=4000")
    turns = parser.parse_args(bench_argv(from_bench("multi-turn", isl=48, osl=16, turns=3), "http://127.0.0.1:9",
                                         "smollm2-135m", 1.5, 20, {}, tmp_path / "m.json", 0))
    assert float(turns.request_rate) == 0.5  # bench's rate is of sessions: 1.5 requests/s are 0.5 sessions of 3 turns


def test_a_pd_split_across_instances_without_a_network_figure_is_infeasible_not_a_crash() -> None:
    from fleetllm.recommend.queueing import kv_transfer_seconds

    step = step_model(SMOL, CPU, CAT.formats["fp32"], 1, None)  # type: ignore[arg-type]
    one = cpu_candidate(replicas=1, prefill_replicas=1)  # both on one 2-core machine: loopback
    three = cpu_candidate(replicas=2, prefill_replicas=1)  # 3 cores: two machines, network_gbps 0
    assert 0 < kv_transfer_seconds(one, step, 1000) < 1
    assert kv_transfer_seconds(three, step, 1000) == float("inf")
