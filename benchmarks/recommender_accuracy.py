"""How well `fleetllm recommend` predicts what a deployment on this machine measures.

For each configuration (replicas 1-4, batch limits, routing policies, a shared-prefix and a multi-turn
workload, speculation and P/D with real workers when asked): the recommender's prediction (the measured
timing profile, queueing by the fleet simulator: the real scheduler in virtual time) against `fleetllm
serve` + `fleetllm bench` at a request rate of ~60% of the predicted capacity, measured 3 times (median).
Metrics: TTFT p50/p90, ITL p50, output throughput; the median and largest relative error, and Kendall's
tau between the predicted and measured ranking by the latency objective (E2E p90).

Simulated workers run the calibrated profile, so their rows test the queueing, routing and serving
path's prediction; real-worker rows (``--real``) also test the profile against the engine as it runs now.

    PYTHONPATH=. python benchmarks/recommender_accuracy.py --output /tmp/acc.json
    PYTHONPATH=. python benchmarks/recommender_accuracy.py --real --runs 1 --requests 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from itertools import islice
from pathlib import Path

import numpy as np
from rich.console import Console

from fleetllm.bench.load import arrival_offsets
from fleetllm.recommend.calibration import Calibration, fit
from fleetllm.recommend.candidate import Candidate
from fleetllm.recommend.catalogue import load_catalogue
from fleetllm.recommend.config import RecommendConfig
from fleetllm.recommend.fleet_sim import simulate
from fleetllm.recommend.model_shape import CATALOGUE
from fleetllm.recommend.queueing import capacity
from fleetllm.recommend.search import step_model
from fleetllm.recommend.speculation import Speculation
from fleetllm.recommend.validate import measure
from fleetllm.recommend.workload import from_bench, with_template

KEYS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "output_tps")
SATURATION = {"ttft_p90_ms": 8000, "e2e_p90_s": 30}  # "capacity" = where latency runs away
CAT = load_catalogue()
# --calibration: the predictions' correction from an earlier --validate; --real-calibration: the real-worker rows' only
# (a simulated worker runs the profile itself, so what the serving path adds to a real engine's steps is not in it)
CALIBRATION = {"simulated": Calibration(), "real": Calibration()}
CPU = CAT.instance("local-cpu")
FP32 = CAT.formats["fp32"]
SMOL = CATALOGUE["smollm2-135m"]


def configs(real: bool) -> list[tuple[str, Candidate, dict, bool]]:
    """(name, candidate, workload parameters, real workers)."""
    short = {"name": "synthetic", "isl": 96, "osl": 24}
    out = [
        ("1 replica, batch 8, least_load", Candidate(CPU, 1, FP32, 1, 8, 256, routing="least_load"), short, False),
        ("1 replica, batch 2, chunk 128", Candidate(CPU, 1, FP32, 1, 2, 128, routing="least_load"), short, False),
        ("2 replicas, batch 8, round_robin", Candidate(CPU, 1, FP32, 2, 8, 256, routing="round_robin"), short, False),
        ("4 replicas, batch 16, least_load", Candidate(CPU, 1, FP32, 4, 16, 256, routing="least_load"), short, False),
        ("2 replicas, kv_aware, shared prefix", Candidate(CPU, 1, FP32, 2, 8, 256, routing="kv_aware"),
         {"name": "shared-prefix", "isl": 32, "osl": 16, "prefix_len": 256}, False),
        ("3 replicas, kv_aware, multi-turn", Candidate(CPU, 1, FP32, 3, 8, 256, routing="kv_aware"),
         {"name": "multi-turn", "isl": 48, "osl": 16, "turns": 3}, False),
    ]
    if real:
        out += [("real: 1 replica, no speculation", Candidate(CPU, 1, FP32, 1, 8, 256, routing="least_load"), short, True),
                ("real: 1 replica, ngram k=4", Candidate(CPU, 1, FP32, 1, 8, 256, Speculation("ngram", 4), "least_load"),
                 short, True),
                ("real: P/D 1+1, threshold 64", Candidate(CPU, 1, FP32, 1, 8, 256, routing="least_load",
                                                         prefill_replicas=1, pd_threshold=64),
                 {"name": "long-short", "isl": 32, "osl": 16, "long_isl": 256, "long_osl": 8, "long_fraction": 0.3}, True)]
    return out


def predicted(c: Candidate, w, rate: float, requests: int, mode: str, seeds: list[int],  # type: ignore[no-untyped-def]
              sent: list[list[tuple[int, int]] | None] | None = None, cal: Calibration = Calibration()) -> dict[str, float]:
    """``warm``: 200 simulated requests, the first tenth left out (what `recommend` does); ``matched``: each
    measured run replayed (its own arrival times, from the bench's seed, its cold caches and, for single
    prompts with no shared prefix, the lengths bench drew: ``sent``, per run), the median over the runs as
    the measurement takes it; ``cal``: the step model's calibration."""
    step = step_model(SMOL, CPU, FP32, 1, None, cal)  # type: ignore[arg-type]
    kv = step.kv_capacity_tokens()
    if mode == "warm":
        sims = [simulate(c, step, w, rate, kv, requests=max(200, requests * 4))]
    else:
        sessions = -(-requests // w.turns)
        sent = sent or [None] * len(seeds)
        sims = [simulate(c, step, as_sent(w, lengths), rate, kv, requests=requests, seed=s, warmup=0,
                         arrivals=list(islice(arrival_offsets(rate / w.turns, s), sessions)))
                for s, lengths in zip(seeds, sent, strict=True)]
    return {k: statistics.median(getattr(p, k) for p in sims) for k in (*KEYS, "e2e_p90_s")} | {"queueing": "simulated"}


def as_sent(w, lengths: list[tuple[int, int]] | None):  # type: ignore[no-untyped-def]
    """``w`` with the (prompt tokens, output tokens) of the requests a run sent, in order (its chat template
    included), where they say all there is to replay: single prompts, no shared prefix."""
    if not lengths or w.turns != 1 or w.shared_prefix:
        return w
    return replace(w, isl=np.array([n for n, _ in lengths], float), osl=np.array([m for _, m in lengths], float))


def sent_lengths(runs_dir: Path, index: int) -> list[tuple[int, int]] | None:
    """What bench sent in a measured run (``validate-INDEX``), in sending order; None if its log is not there."""
    path = runs_dir / f"validate-{index}.bench.requests.jsonl"
    if not path.exists():
        return None
    rows = sorted((json.loads(line) for line in path.read_text().splitlines() if line), key=lambda r: r["start_ms"])
    return [(r["input_tokens"], r["output_tokens"]) for r in rows if not r["warmup"]]


def template_tokens(wp: dict) -> int:
    """What SmolLM2-Instruct's chat template adds: 30 tokens, 14 when the request has a system prompt of its
    own (the template's default system prompt is then left out); measured from the fleet's prompt_tokens."""
    return 14 if wp["name"] in ("shared-prefix", "agentic") or wp.get("system_len") else 30


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1) for i, j in pairs if a[i] != a[j] and b[i] != b[j])
    return s / len(pairs) if pairs else 1.0


def run_one(name: str, c: Candidate, wp: dict, real: bool, args: argparse.Namespace, out: Path, i: int) -> dict:
    # what the bench is asked to send: its generated prompts are random words (fleetllm/bench/workloads.py), on
    # which speculation's acceptance is the "random" category's
    sent = replace(from_bench(**wp), category="random")
    w = with_template(sent, template_tokens(wp)) if args.prediction == "matched" else sent
    cal = CALIBRATION["real" if real else "simulated"]
    step = step_model(SMOL, CPU, FP32, 1, None, cal)  # type: ignore[arg-type]
    if args.measured:  # re-predict an earlier run's measurements at its rates
        old = next(r for r in args.measured["rows"] if r["config"] == name)
        rate, cap = old["rate_rps"], old["capacity_rps"]
    else:
        cap = capacity(c, step, sent, step.kv_capacity_tokens(), SATURATION, 0.2)
        rate = round(args.load * cap, 3)
    # each run its own arrival sample (bench's seed); earlier outputs without "seeds" ran one seed 3 times
    seeds = (old.get("seeds") or [i] * len(old["runs"])) if args.measured else [100 * i + r for r in range(args.runs)]
    # outputs without "seeds" also predate bench_argv's sessions/s: their bench sent `rate` sessions/s
    replayed = rate * w.turns if args.measured and "seeds" not in old else rate
    runs = old["runs"] if args.measured else []
    for r in range(0 if args.measured else args.runs):
        cfg = replace(RecommendConfig(), validate_simulated=not real, validate_requests=args.requests, seed=seeds[r])
        t0 = time.monotonic()
        runs.append(measure(c, SMOL, sent, rate, cfg, out, i * 10 + r, {}))
        print(f"  {name} run {r + 1}: {time.monotonic() - t0:.0f}s {runs[-1]}", flush=True)
    logs = args.measured_runs if args.measured else out
    lengths = [sent_lengths(logs, old.get("index", i) * 10 + r if args.measured else i * 10 + r) for r in range(len(runs))]
    pred = predicted(c, w, replayed, args.requests, args.prediction, seeds, lengths, cal)
    meas = {k: statistics.median(run[k] for run in runs) for k in (*KEYS, "e2e_p90_s")}
    err = {k: (pred[k] - meas[k]) / meas[k] for k in KEYS if meas[k]}
    return {"config": name, "index": i, "workers": "real" if real else "simulated", "rate_rps": rate, "capacity_rps": cap, "seeds": seeds,
            "predicted": pred, "measured": meas, "runs": runs, "relative_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--load", type=float, default=0.6, help="fraction of the predicted capacity")
    ap.add_argument("--real", action="store_true", help="add real-worker rows (speculation, P/D)")
    ap.add_argument("--only", default="", help="comma-separated indices of configurations")
    ap.add_argument("--calibration", help="calibration.json of an earlier `fleetllm recommend --validate`")
    ap.add_argument("--real-calibration", help="a calibration for the real-worker rows only (e.g. --fit-calibration's)")
    ap.add_argument("--fit-calibration", type=Path, help="write the calibration these rows imply (measured vs "
                                                         "predicted, as --validate fits it) to this file")
    ap.add_argument("--prediction", choices=("warm", "matched"), default="matched",
                    help="warm: as `recommend` predicts (long run, warm caches, prompts as sent); matched: the "
                         "measured run's own length and warm-up, and the chat template's tokens")
    ap.add_argument("--measured", type=Path, help="re-predict the measurements of an earlier output (no runs)")
    ap.add_argument("--output", type=Path, default=Path("results/recommender_accuracy.json"))
    args = ap.parse_args()
    CALIBRATION["simulated"] = CALIBRATION["real"] = Calibration.load(args.calibration)
    if args.real_calibration:
        CALIBRATION["real"] = Calibration.load(args.real_calibration)
    if args.measured:  # its runs' bench logs (what each sent) beside it, as this script writes them
        args.measured_runs = args.measured.parent / (args.measured.stem + "-runs")
    args.measured = json.loads(args.measured.read_text()) if args.measured else None
    out = args.output.parent / (args.output.stem + "-runs")
    out.mkdir(parents=True, exist_ok=True)
    chosen = configs(args.real)
    if args.only:
        chosen = [chosen[int(i)] for i in args.only.split(",")]
    rows = []
    for i, cfg in enumerate(chosen):
        rows.append(run_one(*cfg, args, out, i))
        args.output.write_text(json.dumps({"partial": True, "rows": rows}, indent=2) + "\n")  # a later failure keeps these
    errors = [abs(e) for r in rows for e in r["relative_error"].values()]
    tau = kendall_tau([r["predicted"]["e2e_p90_s"] for r in rows], [r["measured"]["e2e_p90_s"] for r in rows])
    doc = {"calibration": {k: vars(v) for k, v in CALIBRATION.items()}, "rows": rows, "median_error": statistics.median(errors), "max_error": max(errors), "kendall_tau": tau,
           "args": {k: str(v) for k, v in vars(args).items() if k != "measured"}}
    args.output.write_text(json.dumps(doc, indent=2) + "\n")
    if args.fit_calibration:  # on top of the calibration these predictions were made with
        fitted = fit(rows, CALIBRATION["real" if all(r["workers"] == "real" for r in rows) else "simulated"])
        args.fit_calibration.write_text(json.dumps({**fitted, "from": str(args.output)}, indent=2) + "\n")
    print_table(rows, doc)


def print_table(rows: list[dict], doc: dict) -> None:
    console = Console(width=200)
    console.print("| configuration | workers | rate | " + " | ".join(f"{k} pred / meas (err)" for k in KEYS) + " |")
    console.print("|---|---|---|" + "---|" * len(KEYS))
    for r in rows:
        cells = [f"{r['predicted'][k]:.3g} / {r['measured'][k]:.3g} ({r['relative_error'].get(k, 0):+.0%})" for k in KEYS]
        console.print(f"| {r['config']} | {r['workers']} | {r['rate_rps']:.3g} | " + " | ".join(cells) + " |")
    console.print(f"median |error| {doc['median_error']:.1%}, max {doc['max_error']:.1%}, Kendall tau (E2E p90 "
                  f"ranking) {doc['kendall_tau']:.2f}")


if __name__ == "__main__":
    main()
