"""Routing policies against each other on the same fleet, workloads and seeds (issue #4).

For each fleet — (a) real workers, (b) simulated workers — and each policy, a fresh fleet is started
with ``fleetllm serve``'s launcher (cold caches), and ``fleetllm bench`` drives three workloads through
the router: multi-turn chat with shared system prompts, agentic sessions with growing contexts, and
Zipf-skewed shared prefixes. Reported per run: TTFT p50/p99 and throughput (from the bench result),
prefix-cache hit rate (from the workers' own ``vllm:prefix_cache_*`` counters, before/after deltas)
and load imbalance: the busiest worker's requests over the mean, and its work (tokens it really
computed: uncached prompt tokens + generated tokens) over the mean. Ratios are against round_robin in
the same run.

    python benchmarks/routing.py                 # full run (see BENCHMARKS.md for its figures)
    python benchmarks/routing.py --quick         # small smoke run
    python benchmarks/routing.py --fleet sim --policies round_robin,kv_aware
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402

from fleetllm.fleet.config import FleetConfig  # noqa: E402
from fleetllm.fleet.launcher import Fleet  # noqa: E402

POLICIES = ("round_robin", "least_load", "session", "prefix", "kv_aware")

# (name, bench flags) per fleet. Closed loops at about half a user per worker: the regime where a
# router's choice shows in TTFT (prefill saved or not) rather than in queues of a saturated fleet.
WORKLOADS = {
    "real": {
        "multi-turn": ["--workload", "multi-turn", "--shared-systems", "4", "--system-len", "384", "--isl", "32",
                       "--osl", "12", "--turns", "4", "--concurrency", "2", "--requests", "32"],
        "agentic": ["--workload", "agentic", "--context-len", "512", "--step-len", "48", "--turns", "8", "--osl", "8",
                    "--concurrency", "2", "--requests", "32"],
        "zipf": ["--workload", "shared-prefix", "--num-prefixes", "12", "--prefix-len", "384", "--isl", "24",
                 "--osl", "12", "--zipf", "1.2", "--concurrency", "2", "--requests", "32"],
    },
    "sim": {
        "multi-turn": ["--workload", "multi-turn", "--shared-systems", "16", "--system-len", "1024", "--isl", "64",
                       "--osl", "24", "--turns", "6", "--concurrency", "16", "--requests", "192"],
        "agentic": ["--workload", "agentic", "--context-len", "2048", "--step-len", "128", "--turns", "12",
                    "--osl", "16", "--concurrency", "16", "--requests", "192"],
        "zipf": ["--workload", "shared-prefix", "--num-prefixes", "64", "--prefix-len", "1024", "--isl", "64",
                 "--osl", "24", "--zipf", "1.2", "--concurrency", "16", "--requests", "192"],
    },
}
QUICK_SCALE = {"--requests": 0.25, "--concurrency": 0.5}

_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfINFNa]+)$')


def scrape(url: str, secret: str) -> dict[str, float]:
    """Counters we need from one worker's /metrics (labels summed); a fleet's workers answer its secret only."""
    out: dict[str, float] = {}
    r = httpx.get(url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {secret}"})
    r.raise_for_status()
    for line in r.text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                                "vllm:request_success_total", "vllm:generation_tokens_total",
                                "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def scale(flags: list[str], quick: bool) -> list[str]:
    if not quick:
        return flags
    out = list(flags)
    for k, f in QUICK_SCALE.items():
        if k in out:
            i = out.index(k) + 1
            out[i] = str(max(2, int(int(out[i]) * f)))
    return out


def with_users(flags: list[str], users: int | None, requests_per_user: float) -> list[str]:
    """``flags`` with ``users`` closed-loop users, each sending about ``requests_per_user`` requests."""
    if users is None:
        return flags
    out = list(flags)
    out[out.index("--concurrency") + 1] = str(users)
    out[out.index("--requests") + 1] = str(max(users, round(users * requests_per_user)))
    return out


def run_one(fleet_kind: str, n_workers: int, policy: str, workloads: dict[str, list[str]], out_dir: Path,
            quick: bool, seed: int, users: int | None = None, requests_per_user: float = 2.0,
            ray_address: str | None = None) -> list[dict]:
    """``ray_address``: the same fleet with its copies as actors of that Ray cluster (benchmarks/ray_fleet.py)."""
    port = 18000 + (os.getpid() % 500) * 40
    cfg = FleetConfig.single_model("smollm2-135m", n_workers, simulate=fleet_kind == "sim", threads=1)
    cfg.port, cfg.policy, cfg.router_args = port, policy, ["--seed", str(seed)]
    label = f"ray-{fleet_kind}" if ray_address else fleet_kind
    cfg.log_dir = str(out_dir / "logs" / f"{label}-{policy}")
    if ray_address:
        from fleetllm.fleet.config import RaySettings
        from fleetllm.fleet.ray_launcher import RayFleet

        cfg.ray = RaySettings(address=ray_address, namespace=f"bench-{os.getpid()}")
        fleet: Fleet = RayFleet(cfg)
    else:
        fleet = Fleet(cfg)
    fleet.start()
    rows = []
    try:
        for wname, flags in workloads.items():
            before = {u: scrape(u, fleet.secret) for u in fleet.worker_urls}
            out = out_dir / f"{label}-{policy}-{wname}.json"
            cmd = [sys.executable, "-m", "fleetllm.cli", "bench", "--url", fleet.url, "--model", "smollm2-135m",
                   "--seed", str(seed), "--no-progress", "--timeout", "600", "--output", str(out),
                   *with_users(scale(flags, quick), users, requests_per_user)]
            t0 = time.monotonic()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wall = time.monotonic() - t0
            after = {u: scrape(u, fleet.secret) for u in fleet.worker_urls}

            def delta(u: str, k: str, a: dict = after, b: dict = before) -> float:
                return a[u].get(k, 0.0) - b[u].get(k, 0.0)

            q = sum(delta(u, "vllm:prefix_cache_queries_total") for u in fleet.worker_urls)
            h = sum(delta(u, "vllm:prefix_cache_hits_total") for u in fleet.worker_urls)
            per_worker = [delta(u, "vllm:request_success_total") for u in fleet.worker_urls]
            mean = sum(per_worker) / len(per_worker)
            # work = tokens the worker really computed: uncached prompt tokens + generated tokens
            work = [delta(u, "vllm:prefix_cache_queries_total") - delta(u, "vllm:prefix_cache_hits_total")
                    + delta(u, "vllm:generation_tokens_total") for u in fleet.worker_urls]
            mean_work = sum(work) / len(work)
            # the workers' own TTFT (arrival at the worker to first token): the rest of the client's is the router's
            n_first = sum(delta(u, "vllm:time_to_first_token_seconds_count") for u in fleet.worker_urls)
            worker_ttft = sum(delta(u, "vllm:time_to_first_token_seconds_sum") for u in fleet.worker_urls) / max(n_first, 1)
            s = json.loads(out.read_text())["runs"][0]["summary"]
            rows.append({
                "fleet": label, "workers": n_workers, "policy": policy, "workload": wname,
                "ttft_p50_ms": s["metrics"]["ttft_ms"]["p50"], "ttft_p99_ms": s["metrics"]["ttft_ms"]["p99"],
                "ttft_mean_ms": s["metrics"]["ttft_ms"].get("mean"), "worker_ttft_mean_ms": worker_ttft * 1000,
                "req_per_s": s["request_throughput"], "out_tok_per_s": s["output_token_throughput"],
                "errors": s["requests"]["errors"], "hit_rate": h / q if q else 0.0,
                "imbalance": max(per_worker) / mean if mean else 0.0, "per_worker_requests": per_worker,
                "work_imbalance": max(work) / mean_work if mean_work else 0.0, "per_worker_work_tokens": work,
                "wall_s": wall,
            })
    finally:
        fleet.stop()
    return rows


def report(rows: list[dict], console: Console) -> list[str]:
    """Print one table per fleet with ratios against round_robin; return the goal verdict lines."""
    verdicts = []
    for fleet_kind in dict.fromkeys(r["fleet"] for r in rows):
        t = Table(title=f"{fleet_kind} fleet ({rows[0]['workers'] if fleet_kind == rows[0]['fleet'] else ''} workers)")
        for c in ("workload", "policy", "TTFT p50 ms", "vs RR", "TTFT p99 ms", "req/s", "vs RR", "hit rate",
                  "max/mean requests", "max/mean work", "errors"):
            t.add_column(c, justify="right" if c not in ("workload", "policy") else "left")
        for r in (r for r in rows if r["fleet"] == fleet_kind):
            rr = next((x for x in rows if x["fleet"] == fleet_kind and x["workload"] == r["workload"]
                       and x["policy"] == "round_robin"), None)
            ttft_ratio = r["ttft_p50_ms"] / rr["ttft_p50_ms"] if rr and rr["ttft_p50_ms"] else float("nan")
            thr_ratio = r["req_per_s"] / rr["req_per_s"] if rr and rr["req_per_s"] else float("nan")
            t.add_row(r["workload"], r["policy"], f"{r['ttft_p50_ms']:.0f}", f"{ttft_ratio:.2f}", f"{r['ttft_p99_ms']:.0f}",
                      f"{r['req_per_s']:.2f}", f"{thr_ratio:.2f}", f"{r['hit_rate']:.1%}", f"{r['imbalance']:.2f}",
                      f"{r['work_imbalance']:.2f}", str(r["errors"]))
            if r["policy"] == "kv_aware" and rr:
                verdicts.append(
                    f"{fleet_kind}/{r['workload']}: kv_aware TTFT p50 {1 - ttft_ratio:+.0%} lower than round_robin "
                    f"(goal >= 80%: {'met' if ttft_ratio <= 0.2 else 'not met'}); hit rate {r['hit_rate']:.0%} vs "
                    f"{rr['hit_rate']:.0%} (goal >= 90%: {'met' if r['hit_rate'] >= 0.9 else 'not met'}); throughput "
                    f"x{thr_ratio:.2f} (goal >= 1: {'met' if thr_ratio >= 0.98 else 'not met'})"
                    + (f"; busiest worker's work / mean {r['work_imbalance']:.2f} (goal <= 1.5: "
                       f"{'met' if r['work_imbalance'] <= 1.5 else 'not met'}; requests {r['imbalance']:.2f})"
                       if r["workload"] == "zipf" else ""))
        console.print(t)
    for v in verdicts:
        console.print(v)
    return verdicts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", default="real,sim", help="real, sim or both (comma list)")
    ap.add_argument("--real-workers", type=int, default=4)
    ap.add_argument("--sim-workers", type=int, default=32)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default="multi-turn,agentic,zipf")
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests, half the concurrency")
    ap.add_argument("--users-per-worker", type=float, default=None,
                    help="closed-loop users per worker (overrides the workloads' concurrency; e.g. 0.5 or 6)")
    ap.add_argument("--requests-per-user", type=float, default=2.0,
                    help="with --users-per-worker: measured requests per user")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="results/routing")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(width=170)
    policies = args.policies.split(",")
    if "round_robin" not in policies:
        policies.insert(0, "round_robin")
    wanted = args.workloads.split(",")
    plan = [(k, args.real_workers if k == "real" else args.sim_workers, p) for k in args.fleet.split(",") for p in policies]
    rows: list[dict] = []
    with Progress(console=console) as bar:
        task = bar.add_task("fleets", total=len(plan))
        for kind, n, policy in plan:
            bar.update(task, description=f"{kind} x{n} {policy}")
            wl = {k: v for k, v in WORKLOADS[kind].items() if k in wanted}
            users = max(1, round(args.users_per_worker * n)) if args.users_per_worker else None
            rows += run_one(kind, n, policy, wl, out_dir, args.quick, args.seed, users, args.requests_per_user)
            bar.advance(task)
    verdicts = report(rows, console)
    summary = {"command": " ".join(sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(), "rows": rows,
               "verdicts": verdicts, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out_dir / "routing.json").write_text(json.dumps(summary, indent=2))
    plot(rows, out_dir / "routing.png")
    console.print(f"wrote {out_dir / 'routing.json'} and {out_dir / 'routing.png'}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = list(dict.fromkeys(r["fleet"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(fleets), 2, figsize=(12, 4 * len(fleets)), squeeze=False)
    for i, f in enumerate(fleets):
        for j, (key, label) in enumerate((("ttft_p50_ms", "TTFT p50 (ms)"), ("hit_rate", "prefix-cache hit rate"))):
            ax = axes[i][j]
            pols = list(dict.fromkeys(r["policy"] for r in rows if r["fleet"] == f))
            width = 0.8 / len(pols)
            for k, p in enumerate(pols):
                vals = [next((r[key] for r in rows if r["fleet"] == f and r["workload"] == w and r["policy"] == p), 0)
                        for w in workloads]
                ax.bar([x + k * width for x in range(len(workloads))], vals, width, label=p)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
            ax.set_title(f"{f} fleet: {label}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
