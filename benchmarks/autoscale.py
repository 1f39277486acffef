"""Autoscaling two models on one fleet against a fixed-size fleet of the same cores.

Two simulated models (timing-model workers, so copies add real capacity on a 2-core machine): load on A
rises in steps while B gets a little traffic and then none. The autoscaled fleet may grow A up to the
fleet's cores and shrink B to zero; the fixed fleet splits the same cores evenly and never changes. For
each, the script records every request (status, TTFT), the copies per model and the autoscaler's
decisions each second, and reports per load step: requests, failures, TTFT p90 of A against its target,
and copies. The timeline (load, copies, TTFT p90) is plotted to PNG.

    python benchmarks/autoscale.py                      # both fleets, ~4 min each
    python benchmarks/autoscale.py --steps 1,3,6 --step-s 40 --fleets autoscaled
    python benchmarks/autoscale.py --fleets real --steps 0.3,2,0.3 --step-s 60   # A as real SmolLM2 copies

``real``: model A's copies load SmolLM2's weights (one core each, up to this machine's cores), so each
scale-up pays a real cold start (process, weights, warm-up); the decision-to-ready time of every new copy
is read from the fleet's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from common import admin_token, stop_process, tail
from rich.console import Console
from rich.table import Table

TTFT_TARGET_S = 1.0
CORES = 8  # declared: two machines of 4 cores; each simulated copy takes one


@dataclass
class Sample:
    t: float
    copies: dict[str, int]
    desired: dict[str, float]


@dataclass
class Run:
    name: str
    records: list[tuple[float, str, int, float | None]] = field(default_factory=list)  # t, model, status, ttft
    samples: list[Sample] = field(default_factory=list)
    admin: dict[str, str] = field(default_factory=dict)  # the header that reads /router/state


def real_fleet_yaml(port: int) -> dict:
    """Model A as real copies (SmolLM2 weights, one core each, at most one per core of this machine); B simulated."""
    cores = os.cpu_count() or 2
    machines = [{"name": f"m{i}", "cores": 1, "memory_gb": 4, "zone": f"zone-{i % 2}"} for i in range(cores)]
    autoscale = {"ttft_p90_s": TTFT_TARGET_S, "concurrency_per_copy": 2, "waiting_per_copy": 1, "down_window_s": 20,
                 "cooldown_s": 5, "idle_s": 30}
    a = {"name": "model-a", "source": "smollm2-135m", "engine": {"max_num_seqs": 8}, "autoscale": autoscale,
         "resources": {"cores": 1, "memory_gb": 2}, "replicas": {"min": 1, "max": cores, "initial": 1}}
    b = {"name": "model-b", "source": "smollm2-135m", "simulate": True, "engine": {"max_num_seqs": 8},
         "resources": {"cores": 0, "memory_gb": 0.1}, "replicas": {"min": 0, "max": 1, "initial": 1},
         "autoscale": autoscale}
    return {"port": port, "policy": "least_load", "machines": machines, "models": [a, b]}


def fleet_yaml(kind: str, port: int, speed: float) -> dict:
    if kind == "real":
        return real_fleet_yaml(port)
    machines = [{"name": n, "cores": CORES // 2, "memory_gb": 8, "zone": f"zone-{n}"} for n in ("a", "b")]
    sim_engine = {"sim_speed": speed, "max_num_seqs": 8}
    autoscale = {"ttft_p90_s": TTFT_TARGET_S, "concurrency_per_copy": 3, "waiting_per_copy": 2, "down_window_s": 20,
                 "cooldown_s": 5,
                 "idle_s": 30}
    if kind == "autoscaled":
        a = {"replicas": {"min": 1, "max": CORES - 1, "initial": 1}, "autoscale": autoscale}
        b = {"replicas": {"min": 0, "max": 2, "initial": 1}, "autoscale": autoscale}
    else:
        a = b = {"replicas": CORES // 2}
    models = [{"name": n, "source": "smollm2-135m", "simulate": True, "engine": sim_engine,
               "resources": {"cores": 1, "memory_gb": 0.1}, **spec} for n, spec in (("model-a", a), ("model-b", b))]
    return {"port": port, "policy": "least_load", "machines": machines, "models": models}


async def one_request(client: httpx.AsyncClient, model: str, run: Run, t0: float, rng: random.Random) -> None:
    body = {"model": model, "prompt": "word " * rng.randint(100, 300), "max_tokens": 24, "stream": True}
    start = time.monotonic()
    ttft, status = None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: {") and ttft is None:
                    ttft = time.monotonic() - start
    except httpx.HTTPError:
        status = -1
    run.records.append((start - t0, model, status, ttft))


async def drive(url: str, steps: list[float], step_s: float, run: Run) -> None:
    """Poisson arrivals for A at each step's rate; B at 0.5 req/s in the first step only."""
    rng = random.Random(1)
    t0 = time.monotonic()
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        sampler = asyncio.create_task(sample(client, run, t0))
        for i, rate in enumerate(steps):
            end = t0 + (i + 1) * step_s
            for model, r in (("model-a", rate), ("model-b", 0.5 if i == 0 else 0.0)):
                if r > 0:
                    tasks.append(asyncio.create_task(arrivals(client, model, r, end, run, t0, rng, tasks)))
            await asyncio.sleep(max(0.0, end - time.monotonic()))
        await asyncio.gather(*tasks)
        await asyncio.sleep(2)
        sampler.cancel()


async def arrivals(client, model, rate, end, run, t0, rng, tasks) -> None:
    while (now := time.monotonic()) < end:
        tasks.append(asyncio.create_task(one_request(client, model, run, t0, rng)))
        await asyncio.sleep(min(rng.expovariate(rate), max(0.0, end - now)))


async def sample(client: httpx.AsyncClient, run: Run, t0: float) -> None:
    while True:
        try:
            state = (await client.get("/router/state", headers=run.admin)).json()
            copies: dict[str, int] = {}
            for w in state["workers"]:
                if w["healthy"] and not w.get("draining") and w["model"]:
                    copies[w["model"]] = copies.get(w["model"], 0) + 1
            metrics = (await client.get("/metrics", params={"federate": "0"})).text
            desired = {line.split('model="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                       for line in metrics.splitlines() if line.startswith("fleetllm_autoscaler_desired_replicas{")}
            run.samples.append(Sample(time.monotonic() - t0, copies, desired))
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(1.0)


def serve(cfg: dict, log_dir: Path) -> subprocess.Popen:
    path = log_dir / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(log_dir / "serve.log", "wb")  # noqa: SIM115 (closed with the process)
    p = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", "serve", "--config", str(path), "--log-dir",
                          str(log_dir), *admin_token(log_dir)[0]], stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 120
    while "fleet ready" not in (log_dir / "serve.log").read_text(errors="replace"):
        if p.poll() is not None or time.monotonic() > end:
            stop_process(p)
            raise RuntimeError("fleet did not start:\n" + tail(log_dir / "serve.log"))
        time.sleep(0.3)
    return p


def p90(values: list[float]) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.9 * len(v)))] if v else None


def summarize(run: Run, steps: list[float], step_s: float) -> list[dict]:
    rows = []
    for i, rate in enumerate(steps):
        lo, hi = i * step_s, (i + 1) * step_s
        recs = [r for r in run.records if lo <= r[0] < hi and r[1] == "model-a"]
        tail_half = [r[3] for r in recs if r[0] >= lo + step_s / 2 and r[3] is not None]  # after the change settles
        copies = [s.copies.get("model-a", 0) for s in run.samples if lo <= s.t < hi]
        b = [s.copies.get("model-b", 0) for s in run.samples if lo <= s.t < hi]
        rows.append({"fleet": run.name, "step": i + 1, "rate_a": rate, "requests_a": len(recs),
                     "failed": sum(1 for r in run.records if lo <= r[0] < hi and r[2] != 200),
                     "ttft_p90_a_2nd_half_s": p90(tail_half), "copies_a_end": copies[-1] if copies else None,
                     "copies_b_end": b[-1] if b else None,
                     "copy_s": sum(sum(s.copies.values()) for s in run.samples if lo <= s.t < hi)})  # 1 s samples
    return rows


def cold_starts(run: Run, model: str = "model-a") -> list[float]:
    """Seconds from each rise of the model's desired copies to that many copies ready (1 s samples)."""
    out, prev = [], None
    for i, s in enumerate(run.samples):
        want = s.desired.get(model)
        if want is not None and prev is not None and want > prev:
            ready = next((t.t for t in run.samples[i:] if t.copies.get(model, 0) >= want), None)
            if ready is not None:
                out.append(round(ready - s.t, 1))
        prev = want if want is not None else prev
    return out


def plot(runs: list[Run], steps: list[float], step_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t_end = len(steps) * step_s
    axes[0].step([i * step_s for i in range(len(steps))] + [t_end], steps + steps[-1:], where="post", label="model-a")
    axes[0].set_ylabel("offered req/s")
    for run in runs:
        ts = [s.t for s in run.samples]
        for m, style in (("model-a", "-"), ("model-b", ":")):
            axes[1].plot(ts, [s.copies.get(m, 0) for s in run.samples], style, label=f"{run.name} {m}")
        wins = [(w, [r[3] for r in run.records if w <= r[0] < w + 5 and r[1] == "model-a" and r[3]])
                for w in range(0, int(t_end), 5)]
        axes[2].plot([w + 2.5 for w, v in wins if v], [p90(v) for _, v in wins if v], label=run.name)
    axes[2].axhline(TTFT_TARGET_S, color="grey", ls="--", label="target")
    axes[1].set_ylabel("ready copies")
    axes[2].set_ylabel("TTFT p90 of A (s, 5 s windows)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="1,3,6,2", help="model-a request rates (req/s), one per step")
    ap.add_argument("--step-s", type=float, default=60.0)
    ap.add_argument("--speed", type=float, default=1.0, help="simulated workers run this much faster than real time")
    ap.add_argument("--fleets", default="autoscaled,fixed")
    ap.add_argument("--port", type=int, default=9300)
    ap.add_argument("--out", default="results/autoscale")
    args = ap.parse_args()
    steps = [float(x) for x in args.steps.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console, runs, rows = Console(), [], []
    for kind in args.fleets.split(","):
        log_dir = Path(tempfile.mkdtemp(prefix=f"fleetllm-autoscale-{kind}-"))
        proc = serve(fleet_yaml(kind, args.port, args.speed), log_dir)
        run = Run(kind, admin=admin_token(log_dir)[1])
        try:
            console.print(f"[bold]{kind}[/]: {len(steps)} steps of {args.step_s:g}s (logs {log_dir})")
            asyncio.run(drive(f"http://127.0.0.1:{args.port}", steps, args.step_s, run))
        finally:
            stop_process(proc)
        runs.append(run)
        rows += summarize(run, steps, args.step_s)
    table = Table(*rows[0].keys())
    for r in rows:
        table.add_row(*[f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()])
    console.print(table)
    for run in runs:
        console.print(f"{run.name}: model-a decision-to-ready seconds per scale-up: {cold_starts(run)}")
    plot(runs, steps, args.step_s, out / "autoscale.png")
    (out / "autoscale.json").write_text(json.dumps({"rows": rows, "args": vars(args),
                                                   "cold_starts": {r.name: cold_starts(r) for r in runs}}, indent=1))
    console.print(f"plot: {out / 'autoscale.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
