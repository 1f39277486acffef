"""Colocated vs disaggregated prefill/decode on the same pinned cores (issue #21).

Two fleets on the same two cores, each worker pinned to its own (``fleetllm worker --cpus``) with one
torch thread: colocated, two ``both`` workers on cores 0 and 1; disaggregated, a prefill worker on core
0 and a decode worker on core 1. ``--fleets`` may add ``auto`` (that split with ``--pd-threshold auto``)
and ``colocated-auto`` (the colocated fleet with ``--pd-threshold auto``: a long prompt is prefilled on
the other worker when that costs its requests less than stalling the chosen one's). Each round runs every fleet once, in alternating order, and there are ``--rounds`` of them:
medians and ranges are reported. Traffic, the same for every fleet: ``--short-users`` streaming users
(closed loop, short prompts) and a steady stream of long documents (``--long-isl`` tokens, constant
arrivals at ``--long-rate``/s: ~10 per fleet per round, 31 per fleet over the 3 rounds, by default: one
quiet core prefills a 1,500-token document in ~4.7 s, so 30 per 75-s round would oversubscribe the
disaggregated fleet's prefill core and measure an ever-growing queue). Reported per fleet: the
short requests' ITL p99 over every gap between streamed chunks, and over only the gaps that overlapped
a long prompt's prefill (sent .. first token); the short requests' output tokens/s; the long ones'
TTFT; the router's P/D decisions.

    python benchmarks/disaggregation.py                    # 3 rounds x 2 fleets x 75 s: ~10 min
    python benchmarks/disaggregation.py --quick            # 1 round x 2 fleets x 30 s: a smoke run
    python benchmarks/disaggregation.py --fleets colocated,colocated-auto --long-rate 0.025 --out results/disaggregation-auto
                                                           # auto when long prompts are rare (~4%): ~10 min
    python benchmarks/disaggregation.py --fleet sim        # the P/D model at 8-64 workers (seconds)
    python benchmarks/disaggregation.py --transfer         # also: KV transfer GB/s (HTTP, shm, memcpy)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model, free_ports  # noqa: E402

from fleetllm.bench.client import ClientConfig, RequestRecord  # noqa: E402
from fleetllm.bench.load import LoadConfig, LoadRunner  # noqa: E402
from fleetllm.bench.metrics import chunk_gaps_ms, stats  # noqa: E402
from fleetllm.bench.tokens import CODE_WORDS, PROSE_WORDS, TokenCounter  # noqa: E402
from fleetllm.bench.workloads import PromptBuilder, SyntheticWorkload  # noqa: E402
from fleetllm.fleet.config import FleetConfig, Machine, ModelSpec, Replicas, Resources  # noqa: E402
from fleetllm.fleet.launcher import Fleet  # noqa: E402

MODEL = "smollm2-135m"


def fleet_config(kind: str, port: int, log_dir: Path) -> FleetConfig:
    """Two pinned one-core workers on this host's first two cores: both+both, or prefill+decode."""
    def spec(role: str, n: int) -> ModelSpec:
        return ModelSpec(source=MODEL, role=role, replicas=Replicas(min=n), resources=Resources(cores=1))

    models = [spec("both", 2)] if kind.startswith("colocated") else [spec("prefill", 1), spec("decode", 1)]
    threshold = {"colocated": None, "colocated-auto": "auto", "disaggregated": 1024, "auto": "auto"}[kind]
    return FleetConfig(port=port, policy="kv_aware", models=models, machines=[Machine(cores=2)],
                       pd_threshold=threshold, log_dir=str(log_dir), restart=False)


def overlapping_gaps(shorts: list[RequestRecord], longs: list[RequestRecord]) -> list[float]:
    """The short requests' chunk gaps (ms) that overlapped some long prompt's prefill (sent .. first token)."""
    spans = sorted((r.start_ns, r.chunk_ns[0]) for r in longs if r.chunk_ns)
    gaps = []
    for r in shorts:
        for a, b in zip(r.chunk_ns, r.chunk_ns[1:], strict=False):
            if any(s < b and a < e for s, e in spans):
                gaps.append((b - a) / 1e6)
    return gaps


async def drive(url: str, args: argparse.Namespace, builder: PromptBuilder) -> tuple[list, list, float]:
    """The short users and the long documents at once; both streams' records and the measured seconds."""
    client = ClientConfig(url, MODEL, request_timeout_s=600.0)
    short = LoadRunner(client, LoadConfig(concurrency=args.short_users, duration_s=args.duration,
                                          warmup_requests=args.short_users, seed=3),
                       SyntheticWorkload(builder, args.short_isl, 0, args.short_osl, 0))
    long = LoadRunner(client, LoadConfig(request_rate=args.long_rate, arrival="constant", duration_s=args.duration,
                                         warmup_requests=1, seed=4),
                      SyntheticWorkload(builder, args.long_isl, 0, args.long_osl, 0))
    t0 = time.perf_counter()
    s, lg = await asyncio.gather(short.run(), long.run())
    return s.records, lg.records, (s.end_ns - s.start_ns) / 1e9 if s.records else time.perf_counter() - t0


def run_fleet(kind: str, args: argparse.Namespace, builders: list[PromptBuilder], out_dir: Path,
              tag: str) -> dict[str, Any]:
    """One fleet, one round: start it, run the traffic, stop it. ``builders`` caches the token calibration."""
    port = free_ports(3)
    fleet = Fleet(fleet_config(kind, port, out_dir / "logs" / f"{kind}-{tag}"))
    fleet.start()
    try:
        if not builders:
            builders.append(calibrated_builder(fleet.url, args.no_tokenize))
        builder = builders[0]
        shorts, longs, seconds = asyncio.run(drive(fleet.url, args, builder))
        metrics = httpx.get(fleet.url + "/metrics", timeout=10).text
    finally:
        fleet.stop()
    pd = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
          if line.startswith("fleetllm_router_pd_decisions_total{")}
    ok_s, ok_l = [r for r in shorts if r.ok], [r for r in longs if r.ok]
    gaps = [g for r in ok_s for g in chunk_gaps_ms(r)]
    during = overlapping_gaps(ok_s, ok_l)
    ttft_long = [(r.chunk_ns[0] - r.start_ns) / 1e6 for r in ok_l if r.chunk_ns]
    return {"fleet": kind, "round": tag, "short_itl_p99_ms": stats(gaps)["p99"],
            "short_itl_p50_ms": stats(gaps)["p50"], "short_itl_p99_during_long_prefill_ms": stats(during)["p99"],
            "gaps": len(gaps), "gaps_during_long_prefill": len(during),
            "short_out_tok_s": sum(r.output_tokens or 0 for r in ok_s) / seconds,
            "short_requests": len(ok_s), "long_requests": len(ok_l), "long_ttft_p50_ms": stats(ttft_long)["p50"],
            "errors": sum(not r.ok for r in shorts + longs), "pd_decisions": pd, "seconds": seconds}


KEYS = ("short_itl_p99_ms", "short_itl_p99_during_long_prefill_ms", "short_out_tok_s", "long_ttft_p50_ms")


def summarize(rows: list[dict[str, Any]], fleets: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per fleet and figure: median, min and max over the rounds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for f in fleets:
        out[f] = {}
        for k in KEYS:
            vals = [r[k] for r in rows if r["fleet"] == f and r[k] is not None]
            if vals:
                out[f][k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def verdicts(summary: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    co = summary.get("colocated", {})
    lines = []
    for f in [f for f in summary if f != "colocated"]:
        di = summary[f]
        if not co or not di:
            continue
        itl = co["short_itl_p99_ms"]["median"] / di["short_itl_p99_ms"]["median"]
        thr = di["short_out_tok_s"]["median"] / co["short_out_tok_s"]["median"]
        lines.append(f"{f}: short-request ITL p99 {itl:.2f}x lower than colocated (goal >= 2x: "
                     f"{'met' if itl >= 2 else 'not met'}); short-request throughput x{thr:.2f} "
                     f"(goal >= 0.9: {'met' if thr >= 0.9 else 'not met'})")
        k = "short_itl_p99_during_long_prefill_ms"
        if k in co and k in di:
            lines.append(f"{f}: ITL p99 of the gaps overlapping a long prefill {co[k]['median']:.0f} -> "
                         f"{di[k]['median']:.0f} ms ({co[k]['median'] / di[k]['median']:.2f}x)")
    return lines


def print_table(console: Console, summary: dict[str, dict[str, dict[str, float]]], rows: list[dict[str, Any]]) -> None:
    t = Table(title=f"short requests while long documents arrive: median [min-max] over {len({r['round'] for r in rows})} "
                    "round(s)")
    for c in ("fleet", "ITL p99 ms", "ITL p99 ms, gaps during a long prefill", "short out tok/s", "long TTFT p50 ms",
              "long prompts / round", "P/D decisions (last round)", "errors"):
        t.add_column(c)

    def cell(f: str, k: str, fmt: str) -> str:
        s = summary[f].get(k)
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]" if s else "-"

    for f in summary:
        mine = [r for r in rows if r["fleet"] == f]
        t.add_row(f, cell(f, KEYS[0], ".0f"), cell(f, KEYS[1], ".0f"), cell(f, KEYS[2], ".1f"), cell(f, KEYS[3], ".0f"),
                  ",".join(str(r["long_requests"]) for r in mine), json.dumps(mine[-1]["pd_decisions"]),
                  str(sum(r["errors"] for r in mine)))
    console.print(t)


def plot(summary: dict[str, dict[str, dict[str, float]]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    fleets = list(summary)
    for ax, (k, label) in zip(axes, [(KEYS[0], "short ITL p99 (ms)"), (KEYS[1], "ITL p99 during long prefill (ms)"),
                                     (KEYS[2], "short output tok/s")], strict=True):
        med = [summary[f].get(k, {}).get("median", 0) for f in fleets]
        lo = [m - summary[f].get(k, {}).get("min", m) for f, m in zip(fleets, med, strict=True)]
        hi = [summary[f].get(k, {}).get("max", m) - m for f, m in zip(fleets, med, strict=True)]
        ax.bar(fleets, med, yerr=[lo, hi], capsize=4, color=["#888", "#3a7", "#37a", "#a73"][:len(fleets)])
        ax.set_title(label, fontsize=10)
    fig.suptitle("same 2 pinned cores: median and range over rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_real(args: argparse.Namespace, console: Console, out_dir: Path) -> int:
    fleets = args.fleets.split(",")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores to pin the two workers of each fleet to")
    rows: list[dict[str, Any]] = []
    builders: list[PromptBuilder] = []
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    console.print(f"load average before: {' '.join(load_before)} ({os.cpu_count()} cores; a quiet machine reads < 0.5)")
    for rnd in range(args.rounds):
        order = fleets if rnd % 2 == 0 else fleets[::-1]  # alternate: neither fleet always runs first
        for kind in order:
            console.print(f"round {rnd + 1}/{args.rounds}: {kind}, {args.duration:.0f} s ...")
            rows.append(run_fleet(kind, args, builders, out_dir, str(rnd + 1)))
            r = rows[-1]
            console.print(f"  ITL p99 {r['short_itl_p99_ms']:.0f} ms (during long prefill "
                          f"{r['short_itl_p99_during_long_prefill_ms'] or 0:.0f}), short {r['short_out_tok_s']:.1f} "
                          f"tok/s, {r['long_requests']} long, P/D {r['pd_decisions']}, {r['errors']} errors")
    summary = summarize(rows, fleets)
    print_table(console, summary, rows)
    lines = verdicts(summary)
    for f in fleets:
        n = sum(r["long_requests"] for r in rows if r["fleet"] == f)
        lines.append(f"{f}: {n} long prompts over {args.rounds} round(s) (at least 30: {'yes' if n >= 30 else 'no'})")
    for v in lines:
        console.print(v)
    console.print(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    doc = {"command": " ".join(sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3], "args": vars(args), "rows": rows,
        "summary": summary, "verdicts": lines}
    if args.transfer:
        from disaggregation_transfer import transfer_throughput

        doc["transfer"] = transfer_throughput(128, 3, out_dir)
        console.print(doc["transfer"])
    (out_dir / "disaggregation.json").write_text(json.dumps(doc, indent=2))
    png = plot(summary, out_dir / "disaggregation.png")
    console.print(f"wrote {out_dir / 'disaggregation.json'}" + (f", {png}" if png else ""))
    return 0


def calibrated_builder(url: str, assume: bool) -> PromptBuilder:
    """Prompt sizes in the server's tokens (its /tokenize), unless told to assume one token per word."""
    if assume:
        return PromptBuilder()
    counter = TokenCounter(url, MODEL)
    return PromptBuilder(counter.tokens_per_word(PROSE_WORDS), counter.tokens_per_word(CODE_WORDS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", choices=("real", "sim"), default="real",
                    help="real: pinned workers on this machine; sim: the P/D model at 8-64 workers")
    ap.add_argument("--fleets", default="colocated,disaggregated",
                    help="comma-separated, of colocated, disaggregated, auto, colocated-auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=75.0, help="seconds of traffic per fleet per round")
    ap.add_argument("--short-users", type=int, default=3)
    ap.add_argument("--short-isl", type=int, default=48)
    ap.add_argument("--short-osl", type=int, default=64)
    ap.add_argument("--long-isl", type=int, default=1500)
    ap.add_argument("--long-osl", type=int, default=8)
    # one quiet core prefills ~320 tokens/s (SmolLM2-135M, fp32): a 1,500-token document is ~4.7 s of it, so
    # 0.14/s keeps the prefill core ~65% busy; 0.45/s would oversubscribe it (a queue that only grows)
    ap.add_argument("--long-rate", type=float, default=0.14, help="long documents per second (constant arrivals)")
    ap.add_argument("--no-tokenize", action="store_true", help="assume one token per word (no /tokenize)")
    ap.add_argument("--transfer", action="store_true", help="also measure KV transfer GB/s")
    ap.add_argument("--quick", action="store_true", help="1 round of 30 s per fleet")
    ap.add_argument("--out", default="results/disaggregation")
    args = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(width=170)
    if args.fleet == "sim":
        from disaggregation_sim import run_sim

        return run_sim(console, out_dir)
    if args.quick:
        args.rounds, args.duration = 1, 30.0
    return run_real(args, console, out_dir)


if __name__ == "__main__":
    sys.exit(main())
