"""Agent sessions on 2 workers whose KV pools hold a quarter of the sessions' KV: the host-memory tier on vs off.

Issue #38's goal: long multi-turn agent sessions (``fleetllm bench --workload agentic``, 16 sessions, contexts
growing past 4k tokens) on two real SmolLM2 workers (one torch thread each) behind a ``kv_aware`` router, the
pools sized to about a quarter of the live sessions' KV (``--pool-fraction`` of sessions x max context). Under
that pressure a session's context is evicted while it thinks; without tiers its next turn prefills it all
again; with ``--kv-offload-gb`` the evicted blocks come back from host memory. Tools run ``--think-time`` seconds
between turns (25: two single-thread workers recomputing 16 growing contexts are then busy but not saturated;
at 1 s both configurations are all queue, and sessions spill between workers). Per configuration (a fresh fleet
each): returning turns' (turn >= 1) prompt-cache hit rate (cached / prompt tokens), their reuse rate (cached /
the previous turn's prompt and output: what a cache could hold), TTFT p50 and p90, output throughput, turns
served, and the TTFT p50 of each turn index. Goals: with the tier, hit rate >= 90% of what is reusable, TTFT p50
>= 3x lower, throughput not lower.

Sessions start over ``--ramp-up`` seconds (25, one think time), as agents arrive. Started in one instant they
return in lock-step: every first turn's prefill shares the two workers, their replies end together, and the
next turns come back as one burst again; those first turns, whose contexts the pools still hold whole (the
pools are a quarter of the sessions' KV at their largest), queue the same with or without a tier and set the
median of a 300 s run.

    python benchmarks/kv_tiers_agentic.py --rounds 2                    # the measured run
    python benchmarks/kv_tiers_agentic.py --sessions 4 --duration 60 --no-save   # a smaller one
    python benchmarks/kv_tiers_agentic.py --configs no-tier --first-round 1     # one configuration a command
    python benchmarks/kv_tiers_agentic.py --report                             # the table of the rows so far
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_ports, save_run, stop_process, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "fleetllm.cli"]
BLOCK = 16  # the workers' KV block size (their default): pools are sized in blocks, whatever the KV dtype
WORKLOAD = ["--workload", "agentic", "--system-len", "512", "--context-len", "128", "--step-len", "100",
            "--step-len-max", "600", "--turns", "40", "--osl", "16"]


def fleet(tmp: Path, pool_blocks: int, offload_gb: float) -> tuple[str, list[str], list[subprocess.Popen[bytes]]]:
    """Two workers and a kv_aware router, started and healthy: the router's URL, the workers', the processes."""
    base = free_ports(3)
    workers = [f"http://127.0.0.1:{base + i}" for i in (1, 2)]
    procs: list[subprocess.Popen[bytes]] = []
    tier = ["--kv-offload-gb", str(offload_gb)] if offload_gb else []
    for i in range(len(workers)):  # started together, waited for after: their cold starts overlap
        procs.append(subprocess.Popen(CLI + ["worker", "--model", "smollm2-135m", "--port", str(base + 1 + i),
                                             "--num-threads", "1", "--num-blocks", str(pool_blocks), *tier,
                                             "--log-level", "warning"],
                                      stdout=open(tmp / f"worker{i}.log", "wb"), stderr=subprocess.STDOUT, cwd=ROOT))
    for i, url in enumerate(workers):
        wait_healthy(url + "/health", procs[i], tmp / f"worker{i}.log")
    log = tmp / "router.log"
    procs.append(subprocess.Popen(CLI + ["router", "--workers", ",".join(workers), "--policy", "kv_aware",
                                         "--port", str(base), "--log-level", "warning"],
                                  stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT))
    router = f"http://127.0.0.1:{base}"
    wait_healthy(router + "/health", procs[-1], log)
    return router, workers, procs


def returning(records: list[dict]) -> dict:
    """Returning turns' hit rate, reuse rate and TTFT, from the bench's per-request records."""
    done = [r for r in records if not r["warmup"] and not r["error"] and not r["cancelled"] and r.get("ttft_ms")]
    prev = {(r["session_id"], r["turn"]): r for r in done}
    back = [r for r in done if r["turn"] >= 1 and r["input_tokens"] and r["cached_tokens"] is not None]
    cached = sum(r["cached_tokens"] for r in back)
    reusable = 0
    for r in back:
        p = prev.get((r["session_id"], r["turn"] - 1))
        held = (p["input_tokens"] + (p["output_tokens"] or 0)) if p else r["cached_tokens"]
        reusable += min(held, r["input_tokens"] - 1)
    ttft = sorted(r["ttft_ms"] for r in back)
    return {"turns": len(back), "first_turns": sum(1 for r in done if r["turn"] == 0), **misses(back, prev),
            "hit": cached / sum(r["input_tokens"] for r in back) if back else None,
            "reuse": cached / reusable if reusable else None,
            "ttft_p50": statistics.median(ttft) if ttft else None,
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
            "prompt_mean": statistics.mean(r["input_tokens"] for r in back) if back else None,
            "ttft_p50_by_turn": by_turn(done)}


def by_turn(done: list[dict]) -> dict[str, list[float]]:
    """Per turn index: [TTFT p50 ms, turns, mean prompt tokens, cached / prompt tokens] (where the median comes from)."""
    turns: dict[int, list[dict]] = {}
    for r in done:
        turns.setdefault(r["turn"], []).append(r)
    return {str(t): [statistics.median(r["ttft_ms"] for r in rs), len(rs),
                     statistics.mean(r["input_tokens"] or 0 for r in rs),
                     sum(r["cached_tokens"] or 0 for r in rs) / max(1, sum(r["input_tokens"] or 0 for r in rs))]
            for t, rs in sorted(turns.items())}


def misses(back: list[dict], prev: dict) -> dict:
    """Where returning turns lost reusable tokens: turns sent to another worker than their previous turn's
    (``moved``: their lost tokens), and turns that stayed yet missed part (``stayed``)."""
    moved = stayed = moved_lost = stayed_lost = 0
    for r in back:
        p = prev.get((r["session_id"], r["turn"] - 1))
        if p is None:
            continue
        lost = max(0, min(p["input_tokens"] + (p["output_tokens"] or 0), r["input_tokens"] - 1) - r["cached_tokens"])
        if r.get("worker") and p.get("worker") and r["worker"] != p["worker"]:
            moved, moved_lost = moved + 1, moved_lost + lost
        elif lost > 16:  # more than a partial block
            stayed, stayed_lost = stayed + 1, stayed_lost + lost
    return {"moved_turns": moved, "moved_lost_tokens": moved_lost, "stayed_missing_turns": stayed,
            "stayed_lost_tokens": stayed_lost}


def metric(urls: list[str], name: str, label: str = "") -> float:
    """The sum of the samples of ``name`` (holding ``label``, e.g. ``reason="spill"``) on ``urls``' /metrics."""
    import httpx

    total = 0.0
    for url in urls:
        r = httpx.get(url + "/metrics?federate=0", timeout=10)
        if r.status_code != 200:
            return float("nan")
        for line in r.text.splitlines():
            if line.split("{")[0].split(" ")[0] == name and label in line:
                total += float(line.split()[-1])
    return total


def run(label: str, args: argparse.Namespace, pool_blocks: int, offload_gb: float, out: Path, rnd: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kv-tiers-agentic-"))
    router, workers, procs = fleet(tmp, pool_blocks, offload_gb)
    try:
        result = out / f"{label.replace(' ', '-')}-{rnd}.json"
        subprocess.run(CLI + ["bench", "--url", router, "--model", "smollm2-135m", *WORKLOAD,
                              "--concurrency", str(args.sessions), "--max-context", str(args.max_context),
                              "--think-time", str(args.think_time), "--ramp-up", str(args.ramp_up),
                              "--duration", str(args.duration), "--seed", "1", "--no-progress",
                              "--output", str(result)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        records = [json.loads(ln) for ln in result.with_suffix(".requests.jsonl").read_text().splitlines()]
        summary = json.loads(result.read_text())["runs"][0]["summary"]
        row = {"config": label, "round": rnd, **returning(records), "output_tps": summary["output_token_throughput"],
               "failed": summary["requests"]["errors"],
               "tier_block_hits": metric(workers, "fleetllm:kv_tier_hits_total"),
               "tier_block_misses": metric(workers, "fleetllm:kv_tier_misses_total"),
               "tier_used_gib": [metric([w], "fleetllm:kv_tier_used_bytes") / 2**30 for w in workers],
               "preemptions": metric(workers, "vllm:num_preemptions_total"),
               "tier_load_s_mean": metric(workers, "fleetllm:kv_tier_load_seconds_sum")
               / max(1.0, metric(workers, "fleetllm:kv_tier_load_seconds_count")),
               "spills": metric([router], "fleetllm_router_decisions_total", 'reason="spill"'),
               "load": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
    finally:
        for p in reversed(procs):
            stop_process(p)
    shutil.rmtree(tmp, ignore_errors=True)  # the servers' logs: kept only when the run failed
    return row


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(rows: list[dict]) -> str:
    lines = ["| config | returning turns | prompt hit rate | reuse rate | TTFT p50 | TTFT p90 | mean prompt | "
             "output tok/s | tier block hits | spills | moved turns (tokens lost) | stayed, missed (tokens lost) | "
             "preemptions | failed |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['turns']} | {pct(r['hit'])} | {pct(r['reuse'])} | "
                     f"{r['ttft_p50']:.0f} ms | {r['ttft_p90']:.0f} ms | {r['prompt_mean']:.0f} | "
                     f"{r['output_tps']:.1f} | {r['tier_block_hits']:.0f} | {r['spills']:.0f} | "
                     f"{r['moved_turns']} ({r['moved_lost_tokens']}) | {r['stayed_missing_turns']} "
                     f"({r['stayed_lost_tokens']}) | {r['preemptions']:.0f} | {r['failed']} |")
    offs, ons = ([r for r in rows if r["config"] == c] for c in ("no tier", "host tier"))
    if offs and ons and all(r["ttft_p50"] for r in offs + ons):
        def med(rs: list[dict], k: str) -> float:
            return statistics.median(r[k] for r in rs)

        lines.append("")
        lines.append(f"With the host tier (medians of {len(ons)} round(s)): TTFT p50 **{med(offs, 'ttft_p50') / med(ons, 'ttft_p50'):.1f}x** "
                     f"lower (goal >= 3x), reuse rate **{pct(med(ons, 'reuse'))}** (goal >= 90%), throughput "
                     f"x{med(ons, 'output_tps') / med(offs, 'output_tps'):.2f} (goal >= 1).")
    return "\n".join(lines + turn_table(rows)) + "\n"


def turn_table(rows: list[dict]) -> list[str]:
    """TTFT p50 per turn index, each configuration's rounds side by side (turns served, cached share)."""
    turns = sorted({int(t) for r in rows for t in r.get("ttft_p50_by_turn", {})})
    if not turns:
        return []
    head = [f"{r['config']} #{r['round']}" for r in rows]
    out = ["", "TTFT p50 per turn (turns served, cached / prompt tokens):", "",
           "| turn | mean prompt | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(rows)]
    for t in turns:
        cells = [r.get("ttft_p50_by_turn", {}).get(str(t)) for r in rows]
        prompt = max((c[2] for c in cells if c), default=0)
        out.append(f"| {t} | {prompt:.0f} | " + " | ".join(
            f"{c[0]:.0f} ms ({c[1]}, {100 * c[3]:.0f}%)" if c else "-" for c in cells) + " |")
    return out


CONFIGS = {"no-tier": "no tier", "host-tier": "host tier"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of sessions per configuration")
    ap.add_argument("--think-time", type=float, default=25.0,
                    help="seconds an agent's tool runs between turns (its KV idle meanwhile)")
    ap.add_argument("--max-context", type=int, default=4608, help="tokens a session grows to (then a new one starts)")
    ap.add_argument("--pool-fraction", type=float, default=0.25,
                    help="the two pools together hold this fraction of sessions x max context")
    ap.add_argument("--offload-gb", type=float, default=2.5, help="each worker's host tier")
    ap.add_argument("--rounds", type=int, default=1, help="each configuration this many times, alternating")
    ap.add_argument("--ramp-up", type=float, default=25.0,
                    help="seconds over which the sessions start (0: all at once, so they return in bursts)")
    ap.add_argument("--configs", default="no-tier,host-tier",
                    help="which configurations to run (comma list of no-tier, host-tier): one per command keeps "
                         "each run short; their rows add up in OUT/rows.jsonl")
    ap.add_argument("--first-round", type=int, default=0, help="the number of this command's first round")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: the table of every row in OUT/rows.jsonl (runs of other commands)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "kv_tiers_agentic")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if any(c not in CONFIGS for c in configs):
        print(f"kv_tiers_agentic: --configs takes {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    pool_blocks = round(args.pool_fraction * args.sessions * args.max_context / 2 / BLOCK)
    rows_file = args.out / "rows.jsonl"
    rows = [json.loads(ln) for ln in rows_file.read_text().splitlines()] if args.report and rows_file.exists() else []
    start = os.getloadavg()[0]
    for rnd in range(args.first_round, args.first_round + (0 if args.report else args.rounds)):
        for c in configs:
            rows.append(run(CONFIGS[c], args, pool_blocks, args.offload_gb if c == "host-tier" else 0.0, args.out, rnd))
            with rows_file.open("a") as f:
                f.write(json.dumps({**rows[-1], "load_start": start}) + "\n")
    text = table(rows) + (f"\nPools {pool_blocks} blocks of {BLOCK} tokens per worker ({args.pool_fraction:g} of {args.sessions} sessions x "
                          f"{args.max_context} tokens over 2 workers); host tier {args.offload_gb:g} GiB per worker. "
                          "Load average (1 min) at each configuration's start -> end: "
                          + ", ".join(f"{r['config']} {r.get('load_start', start):.1f} -> {r['load']:.1f}" for r in rows)
                          + ".\n")
    print(text)
    if not args.no_save:
        cmd = "python benchmarks/kv_tiers_agentic.py " + " ".join(sys.argv[1:])
        save_run("## KV tiers: agent sessions with the host-memory tier (issue 38)",
                 "Agent sessions (`fleetllm bench " + " ".join(WORKLOAD) + f" --max-context {args.max_context} "
                 f"--think-time {args.think_time:g} --ramp-up {args.ramp_up:g}`) on "
                 "two SmolLM2-135M workers (1 thread each) behind a kv_aware router, pools a quarter of the sessions' "
                 "KV: without tiers, and with `--kv-offload-gb`.", cmd, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
