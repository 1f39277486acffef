"""Agent sessions on a 2-worker SmolLM2 fleet: kv_aware vs round_robin routing, suffix speculation on vs off.

For each configuration a fresh fleet (two real workers of one torch thread each, cold caches, and a
router) is started and ``fleetllm bench --workload agentic`` sweeps the number of concurrent agent
sessions: a shared system prompt with the tool schema, each session's own task context, tool outputs of
a few hundred to 1,500 tokens per turn, think time between turns, contexts growing to the model's 8k
limit. Reported per configuration and sessions: per-user output tok/s (p10, p50), TTFT and prefix-cache
hit rate per turn, and the most sessions that keep every user at or above ``--floor-tps``. A plot of
per-user tok/s against sessions goes to docs/; the run to results/ (its figures go into BENCHMARKS.md).

    python benchmarks/agentic.py                       # the run in BENCHMARKS.md
    python benchmarks/agentic.py --sessions 1,2 --duration 30 --no-append   # a smaller one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import free_ports, save_run, stop_process, tail  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "fleetllm.cli"]
# (label, routing policy, worker --speculative)
CONFIGS = [("kv_aware", "kv_aware", None), ("round_robin", "round_robin", None),
           ("kv_aware+suffix", "kv_aware", "method=suffix")]
# sized for a shared 2-core machine: contexts grow to 4k of the model's 8k (--max-context 8000 on a quiet one)
WORKLOAD = ["--workload", "agentic", "--system-len", "512", "--context-len", "128", "--step-len", "100",
            "--step-len-max", "600", "--turns", "40", "--osl", "16", "--think-time", "1"]


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(CLI + args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(url: str, procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for p, log in zip(procs, logs, strict=True):
            if p.poll() is not None:
                raise RuntimeError(f"a fleet process exited:\n{tail(log)}")
        try:
            # ready only while every process of ours is alive: a port taken meanwhile makes ours exit
            if httpx.get(url + "/health", timeout=2).status_code == 200 and all(p.poll() is None for p in procs):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def run_config(label: str, policy: str, spec: str | None, args: argparse.Namespace, out_dir: Path) -> dict:
    """A fresh fleet for one configuration, the session sweep through its router, the bench result."""
    base = free_ports(3)  # the router, then one port per worker
    ports = [base + 1, base + 2]
    workers = [f"http://127.0.0.1:{port}" for port in ports]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    tmp = Path(tempfile.mkdtemp(prefix="agentic-"))
    try:
        for i, url in enumerate(workers):
            flags = ["worker", "--model", "smollm2-135m", "--port", url.rsplit(":", 1)[1], "--num-threads", "1",
                     "--kv-cache-gb", str(args.kv_cache_gb), "--log-level", "warning"]
            logs.append(tmp / f"worker{i}.log")
            procs.append(start(flags + (["--speculative", spec] if spec else []), logs[-1]))
        for url in workers:
            wait_ready(url, procs, logs)
        logs.append(tmp / "router.log")
        procs.append(start(["router", "--workers", ",".join(workers), "--policy", policy, "--port", str(base),
                            "--log-level", "warning"], logs[-1]))
        router = f"http://127.0.0.1:{base}"
        wait_ready(router, procs, logs)
        out = out_dir / f"{label}.json"
        bench = ["bench", "--url", router, "--model", "smollm2-135m", *WORKLOAD, "--concurrency", args.sessions,
                 "--max-context", str(args.max_context), "--duration", str(args.duration), "--floor-tps", str(args.floor_tps), "--seed", "1",
                 "--no-progress", "--output", str(out)]
        subprocess.run(CLI + bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())
    finally:
        for p in reversed(procs):
            stop_process(p)


def rows(label: str, result: dict) -> list[dict]:
    out = []
    for run in result["runs"]:
        a = run["agent"]
        turns = a["by_turn"]
        out.append({"config": label, "sessions": run["load"]["concurrency"], "users": a["users"],
                    "p10": a["user_tps"]["p10"], "p50": a["user_tps"]["p50"], "floor_met": a["floor_met"],
                    "turns": turns, "output_tps": run["summary"]["output_token_throughput"]})
    return out


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def turn_cells(turns: list[dict], every: int = 2) -> str:
    """TTFT p50 (s) and hit rate of turns 0, 2, 4, ... : how both move as the context grows."""
    return ", ".join(f"t{t['turn']} {t['ttft_p50_ms'] / 1000:.1f}s/{fmt(100 * t['cache_hit_rate'], '.0f') if t['cache_hit_rate'] is not None else '-'}%"
                     for t in turns if t["turn"] % every == 0)


def table(all_rows: list[dict], floor: float, best: dict[str, int | None]) -> str:
    lines = ["| config | sessions | per-user tok/s p10 | p50 | every user ≥ floor | fleet output tok/s | "
             "TTFT p50 / cache hit per turn |", "|---|---|---|---|---|---|---|"]
    for r in all_rows:
        lines.append(f"| {r['config']} | {r['sessions']} | {fmt(r['p10'])} | {fmt(r['p50'])} | "
                     f"{'yes' if r['floor_met'] else 'no'} | {fmt(r['output_tps'])} | {turn_cells(r['turns'])} |")
    lines.append("")
    lines.append(f"Most concurrent sessions with every user at ≥ {floor:g} tok/s: "
                 + ", ".join(f"{k} **{v}**" for k, v in best.items()) + ".")
    return "\n".join(lines) + "\n"


def plot(all_rows: list[dict], floor: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label in dict.fromkeys(r["config"] for r in all_rows):
        rs = [r for r in all_rows if r["config"] == label]
        x = [r["sessions"] for r in rs]
        line = ax.plot(x, [r["p50"] for r in rs], marker="o", label=f"{label} p50")[0]
        ax.plot(x, [r["p10"] for r in rs], marker="v", linestyle="--", color=line.get_color(), label=f"{label} p10")
    ax.axhline(floor, color="grey", linestyle=":", label=f"floor {floor:g} tok/s")
    ax.set_xlabel("concurrent agent sessions (2 workers, 1 core each)")
    ax.set_ylabel("per-user output tok/s")
    ax.set_title("SmolLM2-135M agent sessions on a 2-worker fleet")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="1,2,4", help="concurrent sessions to measure (comma list)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds per point (turns in flight finish)")
    p.add_argument("--max-context", type=int, default=4096, help="tokens a session grows to (SmolLM2: 8192)")
    p.add_argument("--floor-tps", type=float, default=5.0, help="per-user tok/s floor: reading speed (docs/agents.md)")
    p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    p.add_argument("--kv-cache-gb", type=float, default=1.5)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "agentic")
    p.add_argument("--no-append", action="store_true", help="do not save the run to results/")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = args.configs.split(",")
    all_rows, best, loads = [], {}, []
    for label, policy, spec in CONFIGS:
        if label not in wanted:
            continue
        loads.append(os.getloadavg()[0])
        result = run_config(label, policy, spec, args, args.out)
        all_rows += rows(label, result)
        best[label] = result.get("floor_sweep", {}).get("best")
        print(f"{label}: done, load average {os.getloadavg()[0]:.1f}", flush=True)
    loads.append(os.getloadavg()[0])
    (args.out / "rows.json").write_text(json.dumps(all_rows, indent=1))
    plot(all_rows, args.floor_tps, ROOT / "docs" / "agentic_user_tps.png")
    text = table(all_rows, args.floor_tps, best)
    print(text)
    if not args.no_append:
        cmd = "python benchmarks/agentic.py " + " ".join(sys.argv[1:])
        save_run("## Agent sessions: per-user speed floor (issue 20)",
                   "Agent sessions (`fleetllm bench --workload agentic`, see docs/agents.md) on two real SmolLM2 "
                   "workers behind a router. Flags: `" + " ".join(WORKLOAD) + f" --max-context {args.max_context}`.",
                   cmd, text + "\nLoad average (1 min) at each configuration's start: "
                   + ", ".join(f"{v:.1f}" for v in loads) + "; plot: docs/agentic_user_tps.png.\n")


if __name__ == "__main__":
    main()
