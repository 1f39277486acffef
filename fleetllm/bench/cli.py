"""``fleetllm bench``: command-line front end (argparse) of the load generator.

``fleetllm bench --url URL --model M [load] [workload] --output results/run.json`` runs one load
point, a sweep (comma lists for ``--concurrency``/``--request-rate``) or an SLO search
(``--find-max-load``); ``fleetllm bench compare a.json b.json`` prints ratios side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fleetllm.bench.agent import floor_search
from fleetllm.bench.client import CHAT, COMPLETIONS, ClientConfig
from fleetllm.bench.load import ARRIVALS, LoadConfig
from fleetllm.bench.metrics import parse_slos
from fleetllm.bench.report import build_result, compare, print_compare, print_run, write_outputs
from fleetllm.bench.search import Measurer, find_max_load, sweep, with_value
from fleetllm.bench.tokens import CODE_WORDS, PROSE_WORDS, TokenCounter
from fleetllm.bench.workloads import (
    AgenticWorkload,
    MultiTurnWorkload,
    PromptBuilder,
    PromptFileWorkload,
    SharedPrefixWorkload,
    SyntheticWorkload,
    TraceWorkload,
    Workload,
    long_short_workload,
)
from fleetllm.errors import UsageError, existing_file

WORKLOADS = ("synthetic", "shared-prefix", "multi-turn", "agentic", "agent-mix", "long-short", "trace", "prompts")
AGENT_WORKLOADS = ("agentic", "agent-mix")  # reported per user and per turn, with the speed floor


def _floats(text: str | None) -> list[float]:
    return [float(x) for x in text.split(",")] if text else []


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse subparsers object; returns the new parser."""
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible endpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)
    p.set_defaults(func=run_bench_command)
    return p


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """All ``bench`` options (shared by ``fleetllm bench`` and ``python -m fleetllm.bench``)."""
    # Its own dest: the top-level parser already stores the subcommand name in ``command``.
    p.add_argument("bench_command", nargs="?", choices=["compare"], metavar="compare",
                   help="compare two result JSON files")
    p.add_argument("files", nargs="*", help="for compare: a.json b.json")
    g = p.add_argument_group("server")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    g.add_argument("--model", help="model name sent in requests")
    g.add_argument("--endpoint", choices=[CHAT, COMPLETIONS], default=CHAT)
    g.add_argument("--api-key")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (strict servers)")
    g.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    g.add_argument("--no-tokenize", action="store_true", help="do not calibrate prompt sizes with /tokenize")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", help="users in a closed loop, or a cap in rate mode; comma list sweeps")
    g.add_argument("--request-rate", help="arrivals per second; comma list sweeps")
    g.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (arrival=gamma)")
    g.add_argument("--requests", type=int, help="measured requests per load point (default 100 without --duration)")
    g.add_argument("--duration", type=float, help="seconds per load point")
    g.add_argument("--warmup-requests", type=int, default=0)
    g.add_argument("--ramp-up", type=float, default=0.0, help="seconds to ramp users or rate up")
    g.add_argument("--max-waiting-first-token", type=int, help="cap on requests awaiting their first token")
    g.add_argument("--cancel-ratio", type=float, default=0.0, help="fraction of requests aborted mid-stream")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    g.add_argument("--isl", type=float, default=512, help="input tokens (mean)")
    g.add_argument("--isl-std", type=float, default=0)
    g.add_argument("--osl", type=float, default=128, help="output tokens (mean)")
    g.add_argument("--osl-std", type=float, default=0)
    g.add_argument("--isl-osl-mix", help="weighted classes 'isl:osl:weight,...' (synthetic)")
    g.add_argument("--num-prefixes", type=int, default=8)
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of prefix popularity")
    g.add_argument("--turns", type=float, default=4, help="turns per session (multi-turn, agentic)")
    g.add_argument("--turns-std", type=float, default=0)
    g.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    g.add_argument("--system-len", type=int, default=0, help="system prompt tokens (multi-turn; agentic: shared)")
    g.add_argument("--shared-systems", type=int, default=0,
                   help="multi-turn: draw system prompts from this many shared ones (0: one per session)")
    g.add_argument("--long-isl", type=int, default=4096)
    g.add_argument("--long-osl", type=int, default=64)
    g.add_argument("--long-fraction", type=float, default=0.2)
    g.add_argument("--trace", help="JSONL trace (generic/Mooncake or SageMaker capture), or a capture directory "
                                   "(local or s3://bucket/prefix: every endpoint-tier object)")
    g.add_argument("--trace-speedup", type=float, default=1.0)
    g.add_argument("--prompts", type=Path, help="prompt file: text lines or JSONL")
    g = p.add_argument_group("SLOs and search")
    g.add_argument("--slo", default="", help="'ttft_ms=500,tpot_ms=50' (goodput) and/or 'ttft_p99_ms=800,itl_p99_ms=100'")
    g.add_argument("--find-max-load", action="store_true", help="search the highest load meeting the SLOs")
    g.add_argument("--max-load", type=float, default=256, help="upper bound of the search")
    add_agent_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--output", type=Path, default=Path("results/run.json"))
    g.add_argument("--plots", action="store_true", help="write PNG plots and an HTML report next to the JSON")
    g.add_argument("--no-progress", action="store_true")


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    """The agent-session options of the ``agentic`` workload (docs/agents.md)."""
    g = p.add_argument_group("agent sessions (agentic)")
    g.add_argument("--context-len", type=int, default=4096, help="each session's own context tokens")
    g.add_argument("--step-len", type=int, default=256, help="tool output tokens added per turn")
    g.add_argument("--step-len-max", type=int, default=0, help="tool outputs uniform in [--step-len, --step-len-max] tokens")
    g.add_argument("--max-context", type=int, default=0,
                   help="a session ends before its context would pass this many tokens (0: no limit)")
    g.add_argument("--floor-tps", type=float,
                   help="per-user output tok/s every session must keep; with --find-max-load, search the most "
                        "concurrent sessions that keep it")


def build_workload(args: argparse.Namespace, builder: PromptBuilder) -> Workload:
    """The workload the flags describe."""
    w = args.workload
    if w == "synthetic":
        mix = [(int(a), int(b), float(c)) for a, b, c in
               (item.split(":") for item in args.isl_osl_mix.split(","))] if args.isl_osl_mix else []
        return SyntheticWorkload(builder, args.isl, args.isl_std, args.osl, args.osl_std, mix)
    if w == "shared-prefix":
        return SharedPrefixWorkload(builder, args.num_prefixes, args.prefix_len, int(args.isl), int(args.osl), args.zipf)
    if w == "multi-turn":
        return MultiTurnWorkload(builder, args.turns, args.turns_std, int(args.isl), int(args.osl), args.think_time,
                                 args.system_len, args.shared_systems)
    if w == "agentic":
        return AgenticWorkload(builder, args.context_len, int(args.turns), args.step_len, int(args.osl), args.think_time,
                               args.system_len, args.step_len_max, args.max_context)
    if w == "agent-mix":
        from fleetllm.bench.agent_mix import AgentMixWorkload

        return AgentMixWorkload(args.max_context or AgentMixWorkload.max_context, int(args.turns), args.think_time)
    if w == "long-short":
        return long_short_workload(builder, args.long_isl, args.long_osl, int(args.isl), int(args.osl),
                                   args.long_fraction)
    if w == "trace":
        return TraceWorkload(args.trace, builder, args.trace_speedup, int(args.osl))
    return PromptFileWorkload(args.prompts, int(args.osl))


def calibrate(args: argparse.Namespace) -> tuple[PromptBuilder, dict[str, Any]]:
    """Tokens per word from the server's /tokenize (so client and server agree), else 1.0."""
    if args.no_tokenize or args.workload == "prompts":
        return PromptBuilder(), {"source": "assumed", "prose_tokens_per_word": 1.0, "code_tokens_per_word": 1.0}
    counter = TokenCounter(args.url, args.model)
    prose = counter.tokens_per_word(PROSE_WORDS)
    code = counter.tokens_per_word(CODE_WORDS) if counter.server_side else 1.0
    source = "server /tokenize" if counter.server_side else "assumed"
    return PromptBuilder(prose, code), {"source": source, "prose_tokens_per_word": prose, "code_tokens_per_word": code}


def run_bench(args: argparse.Namespace, console: Console | None = None) -> dict[str, Any]:
    """Run what ``args`` asks for, write the outputs, print the tables; returns the result document."""
    console = console or Console()
    # The main CLI logs at INFO; one line per HTTP request would bury the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_args(args)
    concurrency = [int(v) for v in _floats(args.concurrency)]
    rates = _floats(args.request_rate)
    client = ClientConfig(args.url, args.model, args.endpoint, args.api_key, args.timeout,
                          ignore_eos=not args.no_ignore_eos, extra_body=json.loads(args.extra_body))
    builder, calibration = calibrate(args)
    workload = build_workload(args, builder)
    requests = args.requests if args.requests or args.duration or args.workload == "trace" else 100
    base = LoadConfig(
        concurrency=concurrency[0] if concurrency else (None if rates or args.workload == "trace" else 1),
        request_rate=rates[0] if rates else None, arrival=args.arrival, burstiness=args.burstiness,
        max_requests=requests, duration_s=args.duration, warmup_requests=args.warmup_requests,
        ramp_up_s=args.ramp_up, max_waiting_first_token=args.max_waiting_first_token,
        cancel_ratio=args.cancel_ratio, seed=args.seed)
    slos = parse_slos(args.slo)
    kind, values = ("rate", rates) if rates else ("concurrency", [float(c) for c in concurrency])

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=args.no_progress or not console.is_terminal, transient=True)
    task = progress.add_task("bench", total=requests)
    measure = Measurer(client, workload, slos,
                       on_record=lambda _rec: progress.advance(task),
                       on_start=lambda load: progress.reset(task, description=load.label(), total=requests),
                       agent=args.workload in AGENT_WORKLOADS, floor_tps=args.floor_tps)
    with progress:
        runs, extra = _measure_points(args, measure, base, kind, values, slos)
    config = {"client": {k: v for k, v in vars(client).items() if k != "api_key"}, "workload": args.workload,
              "workload_params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(workload).items()
                                  if k != "builder"},
              "token_calibration": calibration, "slo": args.slo}
    result = build_result(config, runs, **extra)
    paths = write_outputs(result, measure.results, args.output)
    if args.plots:
        from fleetllm.bench.plots import write_html, write_plots

        pngs = write_plots(result, measure.results, args.output)
        paths += pngs + [write_html(result, pngs, args.output.with_suffix(".html"))]
    for run in runs:
        print_run(console, run)
        if "agent" in run:
            console.print(agent_line(run["agent"]))
    for k in ("floor_search", "floor_sweep"):
        if k in extra:
            console.print(f"max sessions with every user at >= {args.floor_tps:g} tok/s: {extra[k]['best']}")
    if "find_max_load" in extra:
        r = extra["find_max_load"]
        console.print(f"max {kind} meeting SLOs: {r['best']} (first failing: {r['first_failing']}"
                      f"{', stopped on saturation' if r['stopped_on_saturation'] else ''})")
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return result


def _measure_points(args: argparse.Namespace, measure: Measurer, base: LoadConfig, kind: str, values: list[float],
                    slos: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The load points the flags ask for (one, a sweep, an SLO search or a floor search) and the search report."""
    extra: dict[str, Any] = {}
    if args.find_max_load and args.floor_tps is not None:
        runs: list[dict[str, Any]] = []
        start = int(values[0]) if values and kind == "concurrency" else 1
        extra["floor_search"] = floor_search(lambda n: _floor_met(measure, base, n, runs), start, int(args.max_load))
        return runs, extra
    if args.find_max_load:
        if not any(s.stat for s in slos):
            raise UsageError("--find-max-load needs aggregate SLOs, e.g. --slo ttft_p99_ms=800")
        start = (int(values[0]) if kind == "concurrency" else values[0]) if values else 1
        report, runs = find_max_load(measure, base, kind, start=start, max_value=args.max_load)
        return runs, {"find_max_load": report}
    runs = sweep(measure, base, kind, values) if len(values) > 1 else [measure(base)]
    if args.floor_tps is not None and kind == "concurrency":
        met = [r["load"]["concurrency"] for r in runs if r.get("agent", {}).get("floor_met")]
        extra["floor_sweep"] = {"floor_tps": args.floor_tps, "best": max(met) if met else None}
    return runs, extra


def _floor_met(measure: Measurer, base: LoadConfig, sessions: int, runs: list[dict[str, Any]]) -> bool:
    run = measure(with_value(base, "concurrency", sessions))
    runs.append(run)
    return bool(run["agent"]["floor_met"])


def agent_line(agent: dict[str, Any]) -> str:
    """One console line of a run's agent view."""
    tps = agent["user_tps"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    turns = " ".join(f"{t['turn']}:{t['ttft_p50_ms']:.0f}ms/{fmt(100 * t['cache_hit_rate']) if t['cache_hit_rate'] is not None else '-'}%"
                     for t in agent["by_turn"])
    floor = "" if agent["floor_tps"] is None else f", floor {agent['floor_tps']:g} {'met' if agent['floor_met'] else 'missed'}"
    turn = agent["turn_tps"]
    return (f"agent: {agent['users']} users, per-user tok/s p10 {fmt(tps['p10'])} p50 {fmt(tps['p50'])}, per turn p10 "
            f"{fmt(turn['p10'])} p50 {fmt(turn['p50'])}{floor}; "
            f"per turn TTFT p50 / cache hit: {turns}")


def run_compare(files: list[str], console: Console | None = None) -> list[dict[str, Any]]:
    """``bench compare a.json b.json``: ratios b/a of the key numbers, run by run."""
    if len(files) != 2:
        raise UsageError(f"compare takes two result files (fleetllm bench compare a.json b.json), not {len(files)}")
    a, b = (_result_file(f) for f in files)
    rows = compare(a, b)
    print_compare(console or Console(), rows, files[0], files[1])
    return rows


def _result_file(path: str) -> dict[str, Any]:
    text = existing_file(path, "result file").read_text()
    try:
        return json.loads(text)
    except ValueError as e:
        raise UsageError(f"result file {path!r} is not JSON ({e}): give what `fleetllm bench --output` wrote") from None


def check_args(args: argparse.Namespace) -> None:
    """Refuse, before any request, what no run can be made of (UsageError, one line)."""
    if not args.model:
        raise UsageError("--model is required: the model name the server serves (its /v1/models)")
    try:
        json.loads(args.extra_body)
    except ValueError as e:
        raise UsageError(f"--extra-body is not JSON ({e}): e.g. --extra-body '{{\"top_p\": 0.9}}'") from None
    parse_slos(args.slo)
    for flag, text in (("--concurrency", args.concurrency), ("--request-rate", args.request_rate)):
        try:
            _floats(text)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: a number or a comma list of numbers (1,2,4)") from None
    if args.workload == "trace" and not args.trace:
        raise UsageError("--workload trace needs --trace FILE (a JSONL trace or a capture directory)")
    if args.workload == "prompts" and not args.prompts:
        raise UsageError("--workload prompts needs --prompts FILE (text lines or JSONL)")
    for flag, path in (("--trace", args.trace), ("--prompts", args.prompts)):
        if path and not str(path).startswith("s3://") and not Path(path).exists():
            raise UsageError(f"{flag} {str(path)!r}: no such file or directory")
    import httpx

    try:  # any answer will do (a 401 or 404 too): a run against nothing would only count connection errors
        httpx.get(f"{args.url.rstrip('/')}/v1/models", timeout=10)
    except httpx.TransportError as e:
        raise UsageError(f"--url {args.url}: no server answers ({type(e).__name__}): start one, or give its "
                         "address") from None


def run_bench_command(args: argparse.Namespace) -> int:
    """Handler for the ``bench`` subcommand."""
    if args.bench_command == "compare":
        run_compare(args.files)
    else:
        run_bench(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fleetllm.bench``."""
    parser = argparse.ArgumentParser(prog="fleetllm bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    try:
        return run_bench_command(parser.parse_args(argv))
    except UsageError as e:
        print(f"fleetllm bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
