"""Cross-check ``fleetllm bench`` against NVIDIA's AIPerf on the same server and the same workload.

What it does, in one run:
  1. starts one fleetllm worker (``python -m fleetllm.cli worker --model smollm2-135m``), waits for /health;
  2. drives it with ``fleetllm bench`` and then with ``aiperf profile`` (one after the other, never at the
     same time): closed loop at a fixed concurrency, a fixed request count, synthetic prompts of ``--isl``
     tokens, exactly ``--osl`` output tokens (both tools send ``"ignore_eos": true`` and the same
     ``max_tokens``; ``temperature`` 0), streaming chat completions, warm-up requests excluded;
  3. optionally does the same against a second server, llama.cpp's ``llama-server`` (``--llama-server``
     starts one on the same GGUF; ``--peer-url`` uses one already running);
  4. parses both tools' JSON (``fleetllm.bench/v1`` and AIPerf's ``profile_export_aiperf.json``), prints a
     table with the ratio fleetllm-bench / AIPerf and PASS/FAIL against the goals (request count equal;
     output-token throughput and TTFT p50 within 10%), and appends it with the date, machine, load
     average and exact command to ``BENCHMARKS.md`` under "fleetllm bench vs AIPerf".

To tell "the tools measure differently" from "the server ran differently", every tool run also records the
server's own latency histograms over that run (``/metrics``), the CPU time of the tool's whole process tree,
and the CPU time other processes used meanwhile (/proc/stat minus this script, the tools and the server).
On 2 cores AIPerf's own processes take CPU from the server, which then runs slower while AIPerf measures it.

The metric-name trap: AIPerf's "Inter Token Latency" is ``(e2e - TTFT) / (output_tokens - 1)`` per request,
which is vLLM's TPOT and fleetllm's ``tpot_ms``; AIPerf's "Inter Chunk Latency" (every gap between chunks,
pooled) is vLLM's ITL and fleetllm's ``chunk_gap_ms``. The table pairs them by definition, not by name.

Setup (once): ``benchmarks/install_aiperf.sh`` (AIPerf 0.13 in its own ~1.2 GB venv under
~/.cache/fleetllm-peers/aiperf-venv, never in the project's env). The model's tokenizer is saved from the
GGUF to ~/.cache/fleetllm-peers/tokenizer-smollm2-135m on first use and handed to AIPerf as a local folder.

Run:  python benchmarks/bench_vs_aiperf.py [--concurrency 4 --requests 24 --isl 128 --osl 32]
          [--rounds 1] [--llama-server [PATH] | --peer-url URL] [--no-pin] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import cpu_model, stop_process, tail
from rich.console import Console
from rich.table import Table

from fleetllm.bench import server_metrics

REPO = Path(__file__).resolve().parent.parent
PEERS = Path.home() / ".cache/fleetllm-peers"
MODEL_ALIAS = "smollm2-135m"
AIPERF_DEFAULT = PEERS / "aiperf-venv/bin/aiperf"
TOKENIZER_DEFAULT = PEERS / f"tokenizer-{MODEL_ALIAS}"
RESULT_MD = REPO / "results" / "bench-vs-aiperf.md"  # git-ignored; BENCHMARKS.md takes its figures by hand
SECTION = "## fleetllm bench vs AIPerf"
SECTION_INTRO = (
    "`benchmarks/bench_vs_aiperf.py`: the same server and workload driven by `fleetllm bench` and by AIPerf "
    "(PyPI `aiperf`), one tool after the other. Goals: request count equal; output-token throughput and "
    "TTFT p50 within 10% of AIPerf's. AIPerf \"ITL\" = fleetllm `tpot_ms` = vLLM TPOT; AIPerf \"ICL\" = "
    "fleetllm `chunk_gap_ms` = vLLM ITL.\n"
)
TOLERANCE = 0.10
OTHER_CPU_FLAG = 0.15  # cores of other processes, averaged over a tool's run, above which it is flagged
HIGH_LOAD = 1.0  # load average before the run above which it is flagged as sharing the machine


@dataclass(frozen=True)
class Workload:
    """What both tools are asked to send."""

    concurrency: int
    requests: int
    isl: int
    osl: int
    warmup: int
    seed: int
    timeout_s: float


@dataclass
class Metrics:
    """One tool's view of one run, in common units (ms, tok/s); None where the tool has no such figure."""

    tool: str
    requests_completed: int
    requests_errors: int
    output_tps: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_mean_ms: float | None
    tpot_mean_ms: float | None
    tpot_p50_ms: float | None  # AIPerf "inter_token_latency"
    chunk_gap_p50_ms: float | None  # AIPerf "inter_chunk_latency"
    e2e_p50_ms: float | None
    input_tokens_mean: float | None
    output_tokens_mean: float | None
    duration_s: float
    wall_s: float = 0.0
    client_cpu_s: float | None = None  # user+sys CPU of the tool's whole process tree, start-up included
    other_cpu_s: float | None = None  # CPU used by processes that are neither the tool nor the server
    server_ttft_mean_ms: float | None = None  # the server's own histograms over the tool's run (warm-up included)
    server_itl_mean_ms: float | None = None
    artifact: str = ""


# (key, label, unit, goal) — goal "equal", a tolerance, or None (shown for information only)
ROWS: tuple[tuple[str, str, str, str | float | None], ...] = (
    ("requests_completed", "requests completed", "", "equal"),
    ("requests_errors", "requests failed", "", None),
    ("output_tps", "output token throughput", "tok/s", TOLERANCE),
    ("ttft_p50_ms", "TTFT p50", "ms", TOLERANCE),
    ("ttft_p99_ms", "TTFT p99", "ms", None),
    ("tpot_p50_ms", "TPOT p50 (AIPerf \"ITL\")", "ms", None),
    ("chunk_gap_p50_ms", "chunk gap p50 (AIPerf \"ICL\", vLLM ITL)", "ms", None),
    ("e2e_p50_ms", "E2E latency p50", "ms", None),
    ("ttft_mean_ms", "TTFT mean", "ms", None),
    ("server_ttft_mean_ms", "server's own TTFT mean, same run", "ms", None),
    ("tpot_mean_ms", "TPOT mean", "ms", None),
    ("server_itl_mean_ms", "server's own per-token ITL mean, same run", "ms", None),
    ("input_tokens_mean", "input tokens / request (usage)", "tok", None),
    ("output_tokens_mean", "output tokens / request (usage)", "tok", None),
    ("duration_s", "measured duration", "s", None),
    ("client_cpu_s", "client CPU time, whole tool", "s", None),
    ("other_cpu_s", "other processes' CPU time meanwhile", "s", None),
)


@dataclass
class TargetResult:
    """Both tools' rounds against one server."""

    name: str
    url: str
    bench: list[Metrics] = field(default_factory=list)
    server_pid: int | None = None  # when this script started the server: its CPU is ours, not "other"
    aiperf: list[Metrics] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Servers

# CPU sets for the server and for the load generators (None: not pinned). A load generator sharing the
# server's cores slows the server down (torch/ggml threads wait on each other when one is preempted), so by
# default the last core is kept for the client and the server gets the others.
PINNING: dict[str, set[int] | None] = {"server": None, "client": None}


def plan_pinning(enabled: bool) -> None:
    """Server on every core but the last, clients on the last (when there are at least 2)."""
    cores = sorted(os.sched_getaffinity(0))
    if enabled and len(cores) >= 2:
        PINNING["server"], PINNING["client"] = set(cores[:-1]), {cores[-1]}
    else:
        PINNING["server"] = PINNING["client"] = None


def _pin(kind: str) -> Any:
    """A ``preexec_fn`` that pins the child to ``PINNING[kind]`` (None when unpinned)."""
    cpus = PINNING.get(kind)
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(cmd: list[str], port: int, name: str, startup_timeout_s: float = 600.0) -> Iterator[tuple[str, int]]:
    """Start ``cmd`` in its own process group, wait until /health answers 200, stop it on exit."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    print(f"starting {name}: {shlex.join(cmd)}  (log {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                            preexec_fn=_pin("server"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail(log.name)}")
            try:
                if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {startup_timeout_s:.0f}s:\n{tail(log.name)}")
            time.sleep(0.5)
        yield base, proc.pid
    finally:
        stop_process(proc)
        log.close()


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat, steal included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | None) -> float:
    """utime + stime of one live process (0 when unknown or gone)."""
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    rest = stat.rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(server_pid: int | None) -> float:
    """This script, its reaped children (the tools) and the live server."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + process_cpu_s(server_pid)


def find_llama_server(explicit: str | None) -> Path | None:
    """``--llama-server PATH``, else $LLAMA_SERVER, else the newest ``llama-server`` under the peers cache, else $PATH."""
    for candidate in (explicit, os.environ.get("LLAMA_SERVER")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    found = sorted((p for p in PEERS.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)),
                   key=lambda p: p.stat().st_mtime, reverse=True) if PEERS.is_dir() else []
    if found:
        return found[0]
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


# ---------------------------------------------------------------------------------------------------
# Tools


def ensure_tokenizer(folder: Path) -> Path:
    """Save the model's tokenizer (from the GGUF) to ``folder`` once, so AIPerf never needs the HF hub."""
    if (folder / "tokenizer.json").is_file():
        return folder
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from fleetllm.models.loader import resolve

    gguf = Path(resolve(MODEL_ALIAS))
    print(f"saving the tokenizer of {gguf.name} to {folder}", flush=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(folder))
    return folder


def _percentile(stats: dict[str, Any] | None, key: str) -> float | None:
    if not stats:
        return None
    v = stats.get(key)
    return float(v) if v is not None else None


def run_fleetllm_bench(url: str, model: str, wl: Workload, out_dir: Path) -> tuple[Metrics, list[str]]:
    """``fleetllm bench`` as a user runs it (a subprocess of this interpreter); returns its metrics and argv."""
    output = out_dir / "fleetllm_bench.json"
    cmd = [sys.executable, "-m", "fleetllm.bench", "--url", url, "--model", model, "--endpoint", "chat",
           "--concurrency", str(wl.concurrency), "--requests", str(wl.requests),
           "--warmup-requests", str(wl.warmup), "--workload", "synthetic", "--isl", str(wl.isl),
           "--isl-std", "0", "--osl", str(wl.osl), "--osl-std", "0", "--seed", str(wl.seed),
           "--timeout", str(wl.timeout_s), "--no-progress", "--output", str(output)]
    wall, cpu = _run(cmd, out_dir / "fleetllm_bench.log", "fleetllm bench")
    doc = json.loads(output.read_text())
    s = doc["runs"][0]["summary"]
    m = s["metrics"]
    return Metrics(
        tool="fleetllm bench",
        requests_completed=int(s["requests"]["completed"]),
        requests_errors=int(s["requests"]["errors"]),
        output_tps=float(s["output_token_throughput"]),
        ttft_p50_ms=_percentile(m.get("ttft_ms"), "p50"),
        ttft_p99_ms=_percentile(m.get("ttft_ms"), "p99"),
        ttft_mean_ms=_percentile(m.get("ttft_ms"), "mean"),
        tpot_mean_ms=_percentile(m.get("tpot_ms"), "mean"),
        tpot_p50_ms=_percentile(m.get("tpot_ms"), "p50"),
        chunk_gap_p50_ms=_percentile(m.get("chunk_gap_ms"), "p50"),
        e2e_p50_ms=_percentile(m.get("e2e_ms"), "p50"),
        input_tokens_mean=_percentile(m.get("input_tokens"), "mean"),
        output_tokens_mean=_percentile(m.get("output_tokens"), "mean"),
        duration_s=float(s["duration_s"]),
        wall_s=wall,
        client_cpu_s=cpu,
        artifact=str(output),
    ), cmd


def aiperf_env() -> dict[str, str]:
    """Environment for AIPerf: no hub traffic, and HF_HUB_OFFLINE *unset*.

    AIPerf 0.13 in offline mode resolves ``--tokenizer`` through ``snapshot_download(local_files_only=True)``,
    which rejects a local folder (``HFValidationError: Repo id must be in the form ...``); online mode hands a
    folder straight to ``AutoTokenizer.from_pretrained``, which reads it without touching the network.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_IMPLICIT_TOKEN="1", NO_COLOR="1", COLUMNS="160")
    return env


def run_aiperf(aiperf: Path, tokenizer: Path, url: str, model: str, wl: Workload, out_dir: Path) -> tuple[Metrics, list[str]]:
    """``aiperf profile`` with the same workload; returns its metrics and argv."""
    art = out_dir / "aiperf"
    cmd = [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer), "--concurrency", str(wl.concurrency),
           "--request-count", str(wl.requests), "--warmup-request-count", str(wl.warmup),
           "--isl", str(wl.isl), "--isl-stddev", "0", "--osl", str(wl.osl), "--osl-stddev", "0",
           # same body as fleetllm bench: max_tokens (not max_completion_tokens), ignore_eos, greedy
           "--use-legacy-max-tokens", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0.0",
           # token counts from the server's usage, as fleetllm bench does (not re-tokenised text)
           "--use-server-token-count",
           "--random-seed", str(wl.seed), "--request-timeout-seconds", str(wl.timeout_s),
           "--artifact-dir", str(art), "--ui-type", "none", "--no-gpu-telemetry", "--no-server-metrics",
           # 2 cores: one worker and one record processor are plenty for a handful of streams
           "--workers-max", "1", "--record-processors", "1"]
    wall, cpu = _run(cmd, out_dir / "aiperf.log", "aiperf", env=aiperf_env())
    doc = json.loads((art / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str) -> float | None:
        return _percentile(doc.get(name), key)

    completed = stat("request_count", "avg")
    errors = stat("error_request_count", "avg") or float(sum(int(e.get("count", 0)) for e in doc.get("error_summary") or []))
    return Metrics(
        tool="aiperf",
        requests_completed=int(completed or 0),
        requests_errors=int(errors or 0),
        output_tps=float(stat("output_token_throughput", "avg") or 0.0),
        ttft_p50_ms=stat("time_to_first_token", "p50"),
        ttft_p99_ms=stat("time_to_first_token", "p99"),
        ttft_mean_ms=stat("time_to_first_token", "avg"),
        tpot_mean_ms=stat("inter_token_latency", "avg"),
        tpot_p50_ms=stat("inter_token_latency", "p50"),
        chunk_gap_p50_ms=stat("inter_chunk_latency", "p50"),
        e2e_p50_ms=stat("request_latency", "p50"),
        input_tokens_mean=stat("input_sequence_length", "avg"),
        output_tokens_mean=stat("output_sequence_length", "avg"),
        duration_s=float(stat("benchmark_duration", "avg") or 0.0),
        wall_s=wall,
        client_cpu_s=cpu,
        artifact=str(art / "profile_export_aiperf.json"),
    ), cmd


def _run(cmd: list[str], log: Path, name: str, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run one tool to completion with its output in ``log``; return (wall s, CPU s of its process tree).

    The CPU time is the RUSAGE_CHILDREN delta: every descendant the tool waited for (AIPerf's services
    included); the server is a child too but is only reaped at the end, so it is not in it.
    """
    print(f"  {name}: {shlex.join(cmd)}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            preexec_fn=_pin("client")).returncode
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0:
        raise RuntimeError(f"{name} exited with {rc} after {wall:.0f}s (log {log}):\n{tail(log)}")
    print(f"  {name}: done in {wall:.0f}s, {cpu:.1f} CPU s", flush=True)
    return wall, cpu


# ---------------------------------------------------------------------------------------------------
# Comparison


def median_metrics(rounds: list[Metrics]) -> Metrics:
    """Per-field median over rounds (one round: itself)."""
    if len(rounds) == 1:
        return rounds[0]

    def med(key: str) -> Any:
        values = [getattr(r, key) for r in rounds if getattr(r, key) is not None]
        return statistics.median(values) if values else None

    return Metrics(
        tool=rounds[0].tool,
        requests_completed=min(r.requests_completed for r in rounds),
        requests_errors=sum(r.requests_errors for r in rounds),
        output_tps=med("output_tps"), ttft_p50_ms=med("ttft_p50_ms"), ttft_p99_ms=med("ttft_p99_ms"),
        ttft_mean_ms=med("ttft_mean_ms"), tpot_mean_ms=med("tpot_mean_ms"),
        server_ttft_mean_ms=med("server_ttft_mean_ms"), server_itl_mean_ms=med("server_itl_mean_ms"),
        tpot_p50_ms=med("tpot_p50_ms"), chunk_gap_p50_ms=med("chunk_gap_p50_ms"), e2e_p50_ms=med("e2e_p50_ms"),
        input_tokens_mean=med("input_tokens_mean"), output_tokens_mean=med("output_tokens_mean"),
        duration_s=med("duration_s"), wall_s=sum(r.wall_s for r in rounds), client_cpu_s=med("client_cpu_s"),
        other_cpu_s=med("other_cpu_s"),
    )


def verdict(key: str, goal: str | float | None, bench: Any, ref: Any, requested: int) -> str:
    """PASS/FAIL for a goal row, "" for an informational one."""
    if goal is None:
        return ""
    if goal == "equal":
        return "PASS" if bench == ref == requested else "FAIL"
    if bench is None or ref is None or not ref:
        return "FAIL"
    return "PASS" if abs(bench / ref - 1.0) <= float(goal) else "FAIL"


def compare_rows(t: TargetResult, requested: int) -> list[list[str]]:
    """Rows: metric, fleetllm bench, AIPerf, ratio, goal, verdict."""
    b, a = median_metrics(t.bench), median_metrics(t.aiperf)
    rows = []
    for key, label, unit, goal in ROWS:
        vb, va = getattr(b, key), getattr(a, key)
        ratio = f"{vb / va:.3f}" if isinstance(vb, int | float) and isinstance(va, int | float) and va else "-"
        goal_text = "= requested" if goal == "equal" else f"±{float(goal):.0%}" if goal is not None else ""
        rows.append([f"{label}{f' ({unit})' if unit else ''}", _fmt(vb), _fmt(va), ratio, goal_text,
                     verdict(key, goal, vb, va, requested)])
    return rows


def side_by_side_rows(targets: list[TargetResult]) -> tuple[list[str], list[list[str]]]:
    """Every target × tool in columns, for servers side by side."""
    cols = ["metric"] + [f"{t.name}: {tool}" for t in targets for tool in ("fleetllm bench", "aiperf")]
    meds = [(median_metrics(t.bench), median_metrics(t.aiperf)) for t in targets]
    rows = []
    for key, label, unit, _goal in ROWS:
        row = [f"{label}{f' ({unit})' if unit else ''}"]
        for b, a in meds:
            row += [_fmt(getattr(b, key)), _fmt(getattr(a, key))]
        rows.append(row)
    return cols, rows


def passed(t: TargetResult, requested: int) -> bool:
    """Every goal row of one target passed."""
    return all(r[-1] != "FAIL" for r in compare_rows(t, requested))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


COMPARE_COLUMNS = ["metric", "fleetllm bench", "aiperf", "bench / aiperf", "goal", "result"]


def print_tables(console: Console, targets: list[TargetResult], requested: int) -> None:
    """The cross-check per server, then the servers side by side."""
    for t in targets:
        table = Table(title=f"fleetllm bench vs AIPerf — {t.name} ({t.url})", title_justify="left")
        for i, c in enumerate(COMPARE_COLUMNS):
            table.add_column(c, justify="left" if i == 0 else "right")
        for row in compare_rows(t, requested):
            style = "red" if row[-1] == "FAIL" else "green" if row[-1] == "PASS" else None
            table.add_row(*row, style=style)
        console.print(table)
    if len(targets) > 1:
        cols, rows = side_by_side_rows(targets)
        table = Table(title="servers side by side (same workload)", title_justify="left")
        for i, c in enumerate(cols):
            table.add_column(c, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


# ---------------------------------------------------------------------------------------------------
# BENCHMARKS.md


def machine_line(load_start: tuple[float, float, float], load_end: tuple[float, float, float]) -> str:
    """Cores, CPU model and load averages at start and end."""
    model = cpu_model()
    fmt = lambda la: ", ".join(f"{x:.2f}" for x in la)  # noqa: E731
    return (f"{len(os.sched_getaffinity(0))} cores (nproc), {model}; load average (1/5/15 min) "
            f"{fmt(load_start)} at start, {fmt(load_end)} at end")


def _md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    return out + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]


def render_markdown(targets: list[TargetResult], wl: Workload, rounds: int, command: str, machine: str,
                    notes: list[str], tool_cmds: dict[str, list[str]], versions: dict[str, str]) -> str:
    """One dated entry: command, machine, workload, one cross-check table per server, side by side, notes."""
    when = dt.datetime.now(dt.UTC)
    lines = [
        f"### {when:%Y-%m-%d %H:%M} UTC", "",
        f"- Command: `{command}`",
        f"- Machine: {machine}",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in versions.items())}",
        f"- Workload: closed loop, concurrency {wl.concurrency}, {wl.requests} measured requests "
        f"(+{wl.warmup} warm-up, excluded), synthetic prompts of {wl.isl} tokens (user message; usage counts add "
        f"the chat template), {wl.osl} output tokens (`max_tokens`, `ignore_eos: true`, `temperature: 0`), "
        f"streaming chat completions; {rounds} round(s) per tool"
        + (", medians over rounds" if rounds > 1 else "") + ".",
    ]
    for name, cmd in tool_cmds.items():
        lines.append(f"- {name}: `{display_cmd(cmd)}`")
    lines.append("")
    for t in targets:
        verdict_text = "all goals PASS" if passed(t, wl.requests) else "some goal FAILED"
        lines += [f"**{t.name}** (`{t.url}`): {verdict_text}", ""]
        lines += _md_table(COMPARE_COLUMNS, compare_rows(t, wl.requests))
        lines.append("")
    if len(targets) > 1:
        cols, rows = side_by_side_rows(targets)
        lines += ["Servers side by side (same workload, each measured by both tools):", ""]
        lines += _md_table(cols, rows)
        lines.append("")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def display_cmd(cmd: list[str]) -> str:
    """``cmd`` for a reader: ``python`` for this interpreter, ``~`` for the home directory."""
    parts = ["python" if c == sys.executable else c for c in cmd]
    return shlex.join(parts).replace(str(Path.home()), "~")


def save_markdown(path: Path, entry: str) -> None:
    """Write this run's ``entry`` to ``path`` (by default ``results/bench-vs-aiperf.md``), replacing the last."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{SECTION}\n\n{SECTION_INTRO}\n{entry}")


# ---------------------------------------------------------------------------------------------------
# Main


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return (out.stdout or out.stderr).strip().splitlines()[-1] if (out.stdout or out.stderr).strip() else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _pkg_version(python: Path, package: str) -> str:
    return _version([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"])


def measure(target: TargetResult, wl: Workload, rounds: int, aiperf: Path, tokenizer: Path, model: str,
            out_root: Path, tool_cmds: dict[str, list[str]]) -> None:
    """``rounds`` × (fleetllm bench, AIPerf) against one server; odd rounds run AIPerf first."""
    for r in range(rounds):
        out_dir = out_root / target.name.replace(" ", "_") / f"round{r + 1}"
        out_dir.mkdir(parents=True, exist_ok=True)
        order = ("bench", "aiperf") if r % 2 == 0 else ("aiperf", "bench")
        print(f"[{target.name}] round {r + 1}/{rounds}: {' then '.join(order)}  (load avg "
              f"{os.getloadavg()[0]:.2f})", flush=True)
        for tool in order:
            before = server_metrics.scrape(target.url)
            busy0, own0 = busy_cpu_s(), own_cpu_s(target.server_pid)
            if tool == "bench":
                m, cmd = run_fleetllm_bench(target.url, model, wl, out_dir)
                target.bench.append(m)
                tool_cmds.setdefault("fleetllm bench command", cmd)
            else:
                m, cmd = run_aiperf(aiperf, tokenizer, target.url, model, wl, out_dir)
                target.aiperf.append(m)
                tool_cmds.setdefault("aiperf command", cmd)
            m.other_cpu_s = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s(target.server_pid) - own0))
            print(f"  other processes used {m.other_cpu_s:.1f} CPU s during it", flush=True)
            derived = (server_metrics.diff(before, server_metrics.scrape(target.url)) or {}).get("derived") or {}
            m.server_ttft_mean_ms = derived.get("server_mean_ttft_ms")
            m.server_itl_mean_ms = derived.get("server_mean_itl_ms")


def explain(targets: list[TargetResult]) -> list[str]:
    """Notes that separate "the tools measure differently" from "the server ran differently"."""
    notes = []
    for t in targets:
        b, a = median_metrics(t.bench), median_metrics(t.aiperf)
        parts = []
        for m in (b, a):
            if m.ttft_mean_ms and m.server_ttft_mean_ms:
                parts.append(f"{m.tool} TTFT mean / server's = {m.ttft_mean_ms / m.server_ttft_mean_ms:.3f}")
            if m.tpot_mean_ms and m.server_itl_mean_ms:
                parts.append(f"{m.tool} TPOT mean / server's ITL mean = {m.tpot_mean_ms / m.server_itl_mean_ms:.3f}")
        if b.server_itl_mean_ms and a.server_itl_mean_ms:
            parts.append(f"the server's own per-token time was {b.server_itl_mean_ms:.0f} ms under fleetllm bench "
                         f"and {a.server_itl_mean_ms:.0f} ms under AIPerf "
                         f"({b.server_itl_mean_ms / a.server_itl_mean_ms:.3f}x)")
        if parts:
            notes.append(f"{t.name}: " + "; ".join(parts) + ". Where each tool agrees with the server's own "
                         "histograms but the server's figures differ between the two runs, the gap is in the "
                         "server's speed during that run (machine load, the client's own CPU), not in how the "
                         "tool measures.")
    return notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=24, help="measured requests per tool and round")
    p.add_argument("--isl", type=int, default=128, help="input tokens (user message)")
    p.add_argument("--osl", type=int, default=32, help="output tokens (exact: ignore_eos)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per tool, not measured")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="alternate the tools this many times; medians")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, s")
    p.add_argument("--worker-url", default=None, help="use this fleetllm worker instead of starting one")
    p.add_argument("--threads", type=int, default=None,
                   help="server threads (default: the server's cores: all but one when pinned)")
    p.add_argument("--aiperf", default=os.environ.get("AIPERF", str(AIPERF_DEFAULT)), help="aiperf executable")
    p.add_argument("--tokenizer-dir", default=str(TOKENIZER_DEFAULT), help="tokenizer folder for AIPerf")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peer-url", default=None, help="also run the workload against this server (e.g. a llama-server)")
    peer.add_argument("--llama-server", nargs="?", const="auto", default=None,
                      help="also start llama.cpp's llama-server on the same GGUF (optional path; default: "
                           "found under ~/.cache/fleetllm-peers)")
    p.add_argument("--llama-threads", type=int, default=None, help="llama-server -t (default: as the worker)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the server to all cores but the last and the tools to the last one")
    p.add_argument("--output-dir", default=None, help="keep both tools' artifacts here (default: a temp dir)")
    p.add_argument("--result-md", default=str(RESULT_MD), help="where this run is written (replacing the last)")
    p.add_argument("--no-record", action="store_true", help="do not write --result-md")
    return p.parse_args(argv)


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # so the servers' ``finally`` blocks stop them


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    console = Console(width=max(Console().width, 120))
    load_start = os.getloadavg()
    wl = Workload(args.concurrency, args.requests, args.isl, args.osl, args.warmup, args.seed, args.timeout)
    aiperf = Path(args.aiperf)
    if not aiperf.is_file():
        console.print(f"[red]aiperf not found at {aiperf}[/red]: run benchmarks/install_aiperf.sh (or pass --aiperf)")
        return 2
    tokenizer = ensure_tokenizer(Path(args.tokenizer_dir))
    plan_pinning(not args.no_pin)
    server_threads = args.threads or len(PINNING["server"] or os.sched_getaffinity(0))
    if PINNING["server"]:
        print(f"pinning: server on cores {sorted(PINNING['server'])} ({server_threads} threads), "
              f"fleetllm bench and AIPerf on {sorted(PINNING['client'] or [])}", flush=True)
    out_root = Path(args.output_dir or tempfile.mkdtemp(prefix="bench_vs_aiperf-"))
    out_root.mkdir(parents=True, exist_ok=True)
    print(f"artifacts: {out_root}   load average {', '.join(f'{x:.2f}' for x in load_start)}", flush=True)

    targets: list[TargetResult] = []
    tool_cmds: dict[str, list[str]] = {}
    notes: list[str] = []
    versions = {"aiperf": _pkg_version(aiperf.parent / "python", "aiperf"),
                "fleetllm": _pkg_version(Path(sys.executable), "fleetllm")}

    # 1. the fleetllm worker
    worker = TargetResult("fleetllm worker", args.worker_url or "")
    if args.worker_url:
        measure(worker, wl, args.rounds, aiperf, tokenizer, MODEL_ALIAS, out_root, tool_cmds)
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "fleetllm.cli", "worker", "--model", MODEL_ALIAS, "--host", "127.0.0.1",
               "--port", str(port), "--num-threads", str(server_threads)]
        with server(cmd, port, "fleetllm-worker") as (url, pid):
            worker.url, worker.server_pid = url, pid
            measure(worker, wl, args.rounds, aiperf, tokenizer, MODEL_ALIAS, out_root, tool_cmds)
    targets.append(worker)

    # 2. optionally a peer server on the same model
    if args.peer_url or args.llama_server:
        peer = TargetResult("llama-server", args.peer_url or "")
        try:
            if args.peer_url:
                peer.name = "peer"
                measure(peer, wl, args.rounds, aiperf, tokenizer, MODEL_ALIAS, out_root, tool_cmds)
            else:
                binary = find_llama_server(None if args.llama_server == "auto" else args.llama_server)
                if binary is None:
                    raise RuntimeError(f"no llama-server binary (looked at $LLAMA_SERVER, under {PEERS}, $PATH)")
                from fleetllm.models.loader import resolve

                port = free_port()
                cmd = [str(binary), "-m", str(resolve(MODEL_ALIAS)), "-c", "4096", "-np", str(wl.concurrency),
                       "-cb", "-t", str(args.llama_threads or server_threads), "--host", "127.0.0.1",
                       "--port", str(port)]
                versions["llama-server"] = _version([str(binary), "--version"])
                with server(cmd, port, "llama-server") as (url, pid):
                    peer.url, peer.server_pid = url, pid
                    measure(peer, wl, args.rounds, aiperf, tokenizer, MODEL_ALIAS, out_root, tool_cmds)
            targets.append(peer)
        except Exception as e:  # the worker's cross-check still stands without the peer
            console.print(f"[red]peer run failed: {e}[/red]")
            notes.append(f"Peer run failed: {str(e).splitlines()[0]}")

    load_end = os.getloadavg()
    print_tables(console, targets, wl.requests)
    console.print(f"load average at start {load_start}, at end {load_end}")

    # The run itself keeps ~2-3 runnable threads (server + client), so only the load *before* it started
    # says whether other jobs were on the machine.
    if load_start[0] > HIGH_LOAD:
        notes.append(f"Other jobs were sharing the 2 cores (load average {load_start[0]:.1f} / {load_start[1]:.1f} "
                     f"over 1 / 5 min before the run started), so absolute figures are low and noisy; the tools "
                     f"ran one after the other, so the ratios compare runs under similar, not equal, load.")
    else:
        notes.append(f"The machine was otherwise idle when the run started (load average {load_start[0]:.2f}); "
                     f"the load during it is the server and the client themselves.")
    for t in targets:
        for m in t.bench + t.aiperf:
            if m.other_cpu_s is not None and m.wall_s and m.other_cpu_s / m.wall_s > OTHER_CPU_FLAG:
                notes.append(f"{t.name}, {m.tool} run: other processes used {m.other_cpu_s:.0f} CPU s over its "
                             f"{m.wall_s:.0f} s ({m.other_cpu_s / m.wall_s:.2f} cores on average): this run shared "
                             f"the machine.")
    if PINNING["server"]:
        notes.insert(0, f"Pinned: the servers ran on core(s) {sorted(PINNING['server'])} with {server_threads} "
                        f"thread(s), both load generators on core(s) {sorted(PINNING['client'] or [])}, so a "
                        f"tool's own CPU use does not slow the server it measures.")
    else:
        notes.insert(0, "Not pinned (--no-pin): server and load generator shared every core.")
    notes += explain(targets)
    notes += [
        "AIPerf runs several processes of its own (system controller, dataset manager, timing manager, worker, "
        "record processor, ZMQ proxies); fleetllm bench is one asyncio process. \"client CPU time\" is each "
        "tool's whole process tree, start-up included: unpinned on 2 cores, that CPU is taken from the server being measured.",
        "Both tools count input/output tokens from the server's `usage` (AIPerf `--use-server-token-count`); "
        "AIPerf's TTFT, \"ITL\" (= TPOT) and output tok/s use the same definitions as fleetllm's "
        "(`docs/bench.md`), and both measure duration from the first measured request's send to the last "
        "response's end.",
        "AIPerf 0.13 is run with HF_HUB_OFFLINE unset: its offline mode passes `--tokenizer` to "
        "`snapshot_download(local_files_only=True)`, which rejects a local folder; with a folder and the hub "
        "unreachable it never downloads anything.",
    ]
    if not args.no_record:
        command = "python benchmarks/bench_vs_aiperf.py" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])
                                                            if (argv if argv is not None else sys.argv[1:]) else "")
        entry = render_markdown(targets, wl, args.rounds, command, machine_line(load_start, load_end), notes,
                                tool_cmds, versions)
        save_markdown(Path(args.result_md), entry)
        console.print(f"this run: {args.result_md} (replace the figures of BENCHMARKS.md's {SECTION!r} with it)")
    return 0 if passed(worker, wl.requests) else 1


if __name__ == "__main__":
    sys.exit(main())
