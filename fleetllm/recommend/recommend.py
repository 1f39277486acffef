"""``fleetllm recommend``: search, simulate the best, validate here if asked, write the outputs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from fleetllm.errors import UsageError, did_you_mean, existing_file
from fleetllm.recommend.calibration import Calibration
from fleetllm.recommend.candidate import LATENCY_KEYS
from fleetllm.recommend.catalogue import load_catalogue, with_profile
from fleetllm.recommend.config import RecommendConfig
from fleetllm.recommend.fleet_sim import simulate
from fleetllm.recommend.fleet_yaml import fleet_yaml
from fleetllm.recommend.model_shape import load_shape
from fleetllm.recommend.perf_model import Efficiency
from fleetllm.recommend.queueing import meets
from fleetllm.recommend.report import entry, print_table, write_pareto_png
from fleetllm.recommend.search import Scored, SearchResult, rank, search
from fleetllm.recommend.workload import WorkloadShape, load_workload

log = logging.getLogger("fleetllm.recommend")


def parse_slo(text: str) -> dict[str, float]:
    """``ttft_p90_ms=500,itl_p99_ms=50,e2e_p90_s=20`` -> {key: limit}; unknown keys are refused by name."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in LATENCY_KEYS:
            raise UsageError(f"--slo: unknown SLO {item!r}{did_you_mean(key, LATENCY_KEYS)} (known: "
                             f"{', '.join(LATENCY_KEYS)}, as KEY=VALUE,...)")
        try:
            out[key] = float(value)
        except ValueError:
            raise UsageError(f"--slo {key}={value}: the limit is a number (e.g. {key}=500)") from None
    return out


def workload_of(cfg: RecommendConfig) -> WorkloadShape:
    return load_workload(cfg.workload, cfg.template_tokens, isl=cfg.isl, osl=cfg.osl, isl_std=cfg.isl_std, osl_std=cfg.osl_std,
                         prefix_len=cfg.prefix_len, turns=cfg.turns, system_len=cfg.system_len,
                         context_len=cfg.context_len, step_len=cfg.step_len, seed=cfg.seed)


def refine(ranked: list[Scored], result: SearchResult, w: WorkloadShape, rate: float, slos: dict[str, float],
           count: int, requests: int, seed: int) -> list[Scored]:
    """The first ``count`` candidates meeting the SLOs, re-predicted by the fleet simulator; re-ranked among
    themselves (a candidate the simulation finds failing moves below those that pass)."""
    head = [s for s in ranked if s.meets_slos][:count]
    for s in head:
        step = result.steps[s.candidate.instance.name, s.candidate.tp, s.candidate.fmt.name]
        sim = simulate(s.candidate, step, w, rate, step.kv_capacity_tokens(), requests, seed)
        sim.capacity_rps, sim.utilization = s.prediction.capacity_rps, s.prediction.utilization
        sim.output_tps = s.prediction.output_tps  # the offered load: below capacity, a window's count is noise
        sim.rel_error += 0.5 * max(0.0, sim.utilization - 0.7)  # as the analytic interval widens near saturation
        sim.extra = {**s.prediction.extra, **sim.extra, "analytic_ttft_p90_ms": s.prediction.ttft_p90_ms}
        s.prediction, s.meets_slos = sim, meets(sim, slos)
    passed = [s for s in head if s.meets_slos]
    return passed + [s for s in ranked if s not in passed]


def rate_for(cfg: RecommendConfig, w: WorkloadShape) -> float:
    """Requests/s: --traffic, or --users turned into a rate by Little's law over a first-guess E2E."""
    if cfg.traffic:
        return cfg.traffic
    assert cfg.users, "check_inputs refuses a config without traffic"
    guess_e2e = 0.5 + w.osl_mean * 0.05  # refined by the caller with the best candidate's prediction
    return cfg.users / guess_e2e


def check_inputs(cfg: RecommendConfig) -> None:
    """Refuse a missing or contradictory load, and files that are not there (UsageError, one line)."""
    if cfg.traffic is not None and cfg.users is not None:
        raise UsageError("give --traffic RATE (requests/s, open loop) or --users N (closed loop), not both")
    if not (cfg.traffic or cfg.users):
        raise UsageError("the load is missing: give --traffic RATE (requests/s, e.g. --traffic 5) or --users N")
    if (cfg.traffic or 0) < 0 or (cfg.users or 0) < 0:
        raise UsageError("--traffic and --users are positive")
    if cfg.calibration:
        existing_file(cfg.calibration, "--calibration")
    if cfg.profile:
        existing_file(cfg.profile, "--profile")
    try:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {cfg.out}: cannot create it ({e.strerror})") from None


def run_recommend(cfg: RecommendConfig, console: Console | None = None) -> dict[str, Any]:
    """Everything ``fleetllm recommend`` does; returns the JSON document (also written to ``cfg.out``)."""
    check_inputs(cfg)
    console = console or Console(stderr=cfg.json, width=200)
    shape, w, slos = load_shape(cfg.model), workload_of(cfg), parse_slo(cfg.slo)
    cat = with_profile(load_catalogue(cfg.catalogue), cfg.profile)
    instances = cat.select(cfg.instances) or None
    rate = rate_for(cfg, w)
    calibration = Calibration.load(cfg.calibration)
    eff = Efficiency(kv_cache_bytes=1.0 if cfg.kv_cache == "fp8" else 2.0)
    result = search(shape, w, rate, slos, cat, max_quality_loss=cfg.max_quality_loss, eff=eff,
                    instances=instances, calibration=calibration)
    ranked = rank(result, cfg.objective, w, rate, slos)
    if cfg.users and ranked and ranked[0].meets_slos:  # closed loop: users / (E2E) with the best one's E2E
        rate = cfg.users / max(1e-3, ranked[0].prediction.e2e_p90_s / 1.3)
        result = search(shape, w, rate, slos, cat, max_quality_loss=cfg.max_quality_loss, eff=eff,
                        instances=instances, calibration=calibration)
        ranked = rank(result, cfg.objective, w, rate, slos)
    if cfg.simulate_top:
        ranked = refine(ranked, result, w, rate, slos, cfg.simulate_top, cfg.sim_requests, cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = _document(cfg, shape.name, w, rate, slos, result, ranked, out)
    if cfg.validate:
        from fleetllm.recommend.validate import validate

        doc["validation"] = validate(ranked, shape, w, rate, cfg, out, console)
    (out / "recommend.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if not cfg.json:
        print_table(console, ranked, rate, cfg.top)
        console.print(f"{result.considered} candidates considered, {result.predicted} predicted in "
                      f"{result.seconds:.1f} s; pruned: {result.pruned}")
        console.print(f"wrote {out / 'recommend.json'}, {out / 'pareto.png'}" + (f", {out / 'fleet.yaml'}" if doc["fleet_yaml"] else "")
                      + (f", {doc['kubernetes']}/ (fleetllm deploy kubernetes)" if doc["kubernetes"] else ""))
    return doc


def _document(cfg: RecommendConfig, model: str, w: WorkloadShape, rate: float, slos: dict[str, float],
              result: SearchResult, ranked: list[Scored], out: Path) -> dict[str, Any]:
    front = write_pareto_png(result, out / "pareto.png")
    best = ranked[0] if ranked and ranked[0].meets_slos else None
    yaml_path = k8s_dir = None
    if best is not None:
        yaml_path = out / "fleet.yaml"
        yaml_path.write_text(fleet_yaml(best.candidate, load_shape(cfg.model)))
        k8s_dir = write_kubernetes(yaml_path, out / "kubernetes")
    return {
        "model": model, "workload": {"name": w.name, "isl_mean": w.isl_mean, "osl_mean": w.osl_mean,
                                     "shared_prefix": w.shared_prefix, "private_prefix": w.private_prefix},
        "rate_rps": rate, "users": cfg.users, "slo": slos, "objective": cfg.objective,
        "search": {"considered": result.considered, "predicted": result.predicted, "pruned": result.pruned,
                   "seconds": result.seconds},
        "ranked": [entry(s, rate) for s in ranked[:cfg.top]],
        "pareto_front": front, "pareto_png": str(out / "pareto.png"),
        "fleet_yaml": str(yaml_path) if yaml_path else None,
        "kubernetes": str(k8s_dir) if k8s_dir else None,
        "note": None if best else "no candidate meets the SLOs at this traffic: the table shows the closest",
    }


def write_kubernetes(fleet_yaml_path: Path, out: Path) -> Path | None:
    """The top choice as Kubernetes manifests (what ``fleetllm deploy kubernetes --config`` writes), or None
    with the reason logged when its fleet YAML does not map onto a cluster."""
    import yaml

    from fleetllm.deploy.kubernetes import KubernetesOptions, write
    from fleetllm.fleet.config import FleetConfig

    try:
        write(FleetConfig.from_dict(yaml.safe_load(fleet_yaml_path.read_text())), KubernetesOptions(), out)
    except ValueError as e:
        logging.getLogger("fleetllm.recommend").warning("no Kubernetes manifests for the top choice: %s", e)
        return None
    return out
