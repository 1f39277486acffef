"""Agent sessions on a 2-worker fleet: the product's own check of per-user speed (issue 41).

For each configuration a fresh fleet (two real workers of one torch thread each, with the worker's default
flags, cold caches, and a router) is started and ``fleetllm bench`` sweeps the number of concurrent agent
sessions. The default workload, ``agent-mix`` (fleetllm/bench/agent_mix.py), is what agents send and get back:
code edits whose reply repeats a function from the prompt, test reports whose failures the reply quotes as JSON,
and JSON tool calls, each turn's reply ended by the model, the context growing to ``--max-context``;
``--workload agentic`` is the older one of word-salad tool outputs and fixed-length replies. Reported per
configuration and sessions: per-turn output tok/s (a turn's (N - 1) / (last - first token time)) p10 and p50,
each session's median turn, TTFT and prefix-cache hit rate per turn, speculation's acceptance, and the most
sessions whose every user keeps a median turn at or above ``--floor-tps``. A plot goes to docs/; the run to
results/.

Configurations: ``kv_aware`` (the defaults: kv_aware routing, suffix speculation), ``kv_aware+no_spec``
(``--speculative none``: what speculation adds), ``round_robin``.

    python benchmarks/agentic.py --sessions 1,4 --duration 60 --configs kv_aware,kv_aware+no_spec
    python benchmarks/agentic.py --model gemma3-270m --sessions 1 --max-context 24576    # 32k-context Gemma 3
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
CONFIGS = [("kv_aware", "kv_aware", None), ("kv_aware+no_spec", "kv_aware", "none"), ("round_robin", "round_robin", None)]
WORKLOADS = {
    "agent-mix": ["--workload", "agent-mix", "--turns", "64", "--think-time", "1", "--no-ignore-eos"],
    "agentic": ["--workload", "agentic", "--system-len", "512", "--context-len", "128", "--step-len", "100",
                "--step-len-max", "600", "--turns", "40", "--osl", "16", "--think-time", "1"],
}
# per model: its worker flags and the context its sessions grow to by default
MODELS = {"smollm2-135m": ([], 8000), "gemma3-270m": (["--max-model-len", "32768"], 24576)}


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
            flags = ["worker", "--model", args.model, "--port", url.rsplit(":", 1)[1], "--num-threads", "1",
                     "--kv-cache-gb", str(args.kv_cache_gb), "--log-level", "warning", *MODELS[args.model][0]]
            logs.append(tmp / f"worker{i}.log")
            procs.append(start(flags + (["--speculative", spec] if spec else []) + args.worker_arg, logs[-1]))
        for url in workers:
            wait_ready(url, procs, logs)
        logs.append(tmp / "router.log")
        procs.append(start(["router", "--workers", ",".join(workers), "--policy", policy, "--port", str(base),
                            "--log-level", "warning"], logs[-1]))
        router = f"http://127.0.0.1:{base}"
        wait_ready(router, procs, logs)
        out = out_dir / f"{label}.json"
        bench = ["bench", "--url", router, "--model", args.model, *WORKLOADS[args.workload], "--concurrency", args.sessions,
                 "--max-context", str(args.max_context), "--duration", str(args.duration), "--floor-tps", str(args.floor_tps), "--seed", "1",
                 "--no-progress", "--output", str(out)]
        subprocess.run(CLI + bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        result["spec"] = [spec_counters(url) for url in workers]
        return result
    finally:
        for p in reversed(procs):
            stop_process(p)


def spec_counters(url: str) -> dict[str, float]:
    """A worker's speculation counters (its whole life: every load point of the configuration)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    out = dict.fromkeys(names.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = names.get(name.split("{")[0])
        if key and not line.startswith("#"):
            out[key] += float(value.split()[0])
    return out


def acceptance(result: dict) -> str:
    """Mean acceptance length (1 + accepted / verify steps) over both workers, and tokens drafted."""
    c = {k: sum(w[k] for w in result["spec"]) for k in ("drafts", "draft_tokens", "accepted")}
    return "-" if not c["drafts"] else f"AL {1 + c['accepted'] / c['drafts']:.2f}, {c['accepted'] / c['draft_tokens']:.0%} of {c['draft_tokens']:.0f} drafts"


def rows(label: str, result: dict) -> list[dict]:
    out = []
    for run in result["runs"]:
        a = run["agent"]
        out.append({"config": label, "sessions": run["load"]["concurrency"], "users": a["users"],
                    "p10": a["turn_tps"]["p10"], "p50": a["turn_tps"]["p50"], "user_min": a["turn_tps"]["user_median_min"],
                    "session_p50": a["user_tps"]["p50"], "floor_met": a["floor_met"], "turns": a["by_turn"],
                    "output_tps": run["summary"]["output_token_throughput"], "spec": acceptance(result)})
    return out


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def turn_cells(turns: list[dict], every: int = 2) -> str:
    """TTFT p50 (s) and hit rate of turns 0, 2, 4, ... : how both move as the context grows."""
    return ", ".join(f"t{t['turn']} {t['ttft_p50_ms'] / 1000:.1f}s/{fmt(100 * t['cache_hit_rate'], '.0f') if t['cache_hit_rate'] is not None else '-'}%"
                     for t in turns if t["turn"] % every == 0)


def table(all_rows: list[dict], floor: float, best: dict[str, int | None]) -> str:
    lines = ["| config | sessions | per-turn tok/s p10 | p50 | slowest user's median turn | every user ≥ floor | "
             "fleet output tok/s | speculation (whole config) | TTFT p50 / cache hit per turn |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        lines.append(f"| {r['config']} | {r['sessions']} | {fmt(r['p10'])} | {fmt(r['p50'])} | {fmt(r['user_min'])} | "
                     f"{'yes' if r['floor_met'] else 'no'} | {fmt(r['output_tps'])} | {r['spec']} | {turn_cells(r['turns'], 4)} |")
    lines.append("")
    lines.append(f"Most concurrent sessions with every user at ≥ {floor:g} tok/s: "
                 + ", ".join(f"{k} **{v}**" for k, v in best.items()) + ".")
    return "\n".join(lines) + "\n"


def plot(all_rows: list[dict], floor: float, path: Path, model: str) -> None:
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
    ax.set_ylabel("per-turn output tok/s")
    ax.set_title(f"{model} agent sessions on a 2-worker fleet")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="1,2,4", help="concurrent sessions to measure (comma list)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds per point (turns in flight finish)")
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="agent-mix")
    p.add_argument("--max-context", type=int, help="tokens a session grows to (default: 8000 SmolLM2, 24576 Gemma 3)")
    p.add_argument("--floor-tps", type=float, default=35.0, help="per-user tok/s each session's median turn must keep")
    p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    p.add_argument("--kv-cache-gb", type=float, default=1.5)
    p.add_argument("--worker-arg", action="append", default=[],
                   help="one more worker flag or value for every configuration (repeat: --worker-arg=--kv-cache-dtype "
                        "--worker-arg=int8)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "agentic")
    p.add_argument("--no-append", action="store_true", help="do not save the run to results/")
    args = p.parse_args()
    args.max_context = args.max_context or MODELS[args.model][1]
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
    plot(all_rows, args.floor_tps, ROOT / "docs" / "agentic_user_tps.png", args.model)
    text = table(all_rows, args.floor_tps, best)
    print(text)
    if not args.no_append:
        cmd = "python benchmarks/agentic.py " + " ".join(sys.argv[1:])
        save_run(f"## Agent sessions: per-user speed, {args.model}, {args.workload}",
                   f"Agent sessions (`fleetllm bench --workload {args.workload}`, see docs/agents.md) on two real "
                   f"{args.model} workers of one thread each behind a router. Flags: `"
                   + " ".join(WORKLOADS[args.workload]) + f" --max-context {args.max_context}`.",
                   cmd, text + "\nLoad average (1 min) at each configuration's start: "
                   + ", ".join(f"{v:.1f}" for v in loads) + "; plot: docs/agentic_user_tps.png.\n")


if __name__ == "__main__":
    main()
