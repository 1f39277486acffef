"""Throughput cost of observability: a worker with everything on vs one with it all off, same run.

What it does:
  1. starts an OTLP/HTTP sink (accepts and discards, in this process) and two workers on the same model:
     ``full``  = metrics + request log lines + OTLP export of metrics (every 5 s) and of request spans;
     ``bare``  = ``--disable-metrics --disable-log-requests``, no OTLP;
  2. drives them in turn with ``fleetllm bench`` (streaming completions, closed loop, fixed concurrency and
     request count, exactly ``--osl`` output tokens), alternating bare/full for ``--rounds`` rounds so that
     drift in the machine's load hits both alike;
  3. prints output-token throughput per run, the median of each, and the ratio full / bare (the goal:
     overhead = 1 - ratio < 3 %); also the in-process cost of the engine's metric events per generated
     token. ``--record`` saves the result and the exact command to results/.

Both workers run side by side, but only one is ever under load; the idle one sleeps in its queue wait.

Run:  python benchmarks/observability_overhead.py [--concurrency 4 --requests 24 --isl 64 --osl 32 --rounds 3] [--record]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_run, stop_process, tail  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start_sink() -> tuple[ThreadingHTTPServer, str]:
    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def start_worker(port: int, flags: list[str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "fleetllm.cli", "worker", "--model", "smollm2-135m", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *flags]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    end = time.monotonic() + 180
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_process(proc)
    raise RuntimeError(f"worker not healthy:\n{tail(log)}")


def bench(url: str, args: argparse.Namespace, out: Path) -> float:
    cmd = [sys.executable, "-m", "fleetllm.cli", "bench", "--url", url, "--model", "smollm2-135m", "--endpoint",
           "completions", "--concurrency", str(args.concurrency), "--requests", str(args.requests), "--isl",
           str(args.isl), "--osl", str(args.osl), "--warmup-requests", "2", "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    if summary["requests"]["errors"]:
        raise RuntimeError(f"{url}: {summary['errors_by_kind']}")
    return float(summary["output_token_throughput"])


def metric_event_cost_us(tokens: int = 20000) -> float:
    """In-process: microseconds of EngineMetrics events per generated token (token + a share of finish)."""
    from fleetllm.engine.metrics import EngineMetrics
    from fleetllm.engine.sampling import SamplingParams
    from fleetllm.engine.sequence import Sequence

    m = EngineMetrics("m", {"worker": "w", "role": "both", "zone": "z", "instance_type": "cpu"})
    per_request = 32
    t0 = time.perf_counter()
    for r in range(tokens // per_request):
        seq = Sequence(str(r), [1] * 64, SamplingParams(), per_request)
        seq.first_scheduled_time = seq.arrival_time
        m.scheduled_first(seq, seq.arrival_time)
        for _ in range(per_request):
            now = time.monotonic()
            m.token(seq, now)
            seq.output_token_ids.append(1)
            seq.first_token_time = seq.first_token_time or now
            seq.last_token_time = now
        m.finished(seq, "length", time.monotonic())
        m.step_gauges(1, 0, 0.1, r * 64, r * 32)
    return (time.perf_counter() - t0) / tokens * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="save the run to results/ (for BENCHMARKS.md)")
    args = ap.parse_args()

    sink, sink_url = start_sink()
    tmp = Path(tempfile.mkdtemp(prefix="fleetllm-obs-overhead-"))
    ports = {"bare": 18611, "full": 18612}
    flags = {"bare": ["--disable-metrics", "--disable-log-requests"],
             "full": ["--otlp-endpoint", sink_url, "--otlp-interval", "5", "--zone", "bench"]}
    procs = {}
    try:
        for name in ("bare", "full"):
            procs[name] = start_worker(ports[name], flags[name], tmp / f"{name}.log")
        tput: dict[str, list[float]] = {"bare": [], "full": []}
        for r in range(args.rounds):
            for name in ("bare", "full") if r % 2 == 0 else ("full", "bare"):
                v = bench(f"http://127.0.0.1:{ports[name]}", args, tmp / f"{name}-{r}.json")
                tput[name].append(v)
                print(f"round {r + 1} {name:4s}: {v:7.2f} output tok/s", flush=True)
    finally:
        for p in procs.values():
            stop_process(p)
        sink.shutdown()
    bare, full = statistics.median(tput["bare"]), statistics.median(tput["full"])
    ratio = full / bare
    cost = metric_event_cost_us()
    summary = (f"median output tok/s: bare {bare:.2f}, full {full:.2f}; ratio full/bare {ratio:.3f} "
               f"(overhead {100 * (1 - ratio):+.1f} %, goal < 3 %); metric events {cost:.1f} us per generated token")
    print(summary)
    if args.record:
        record(args, tput, summary)
    return 0


def record(args: argparse.Namespace, tput: dict[str, list[float]], summary: str) -> None:
    cmd = "python benchmarks/observability_overhead.py " + shlex.join(
        ["--concurrency", str(args.concurrency), "--requests", str(args.requests), "--isl", str(args.isl),
         "--osl", str(args.osl), "--rounds", str(args.rounds)])
    runs = " / ".join(f"{n}: " + ", ".join(f"{v:.2f}" for v in vs) for n, vs in tput.items())
    save_run("## Observability overhead", "A worker with metrics, request log lines and OTLP export (metrics every "
               "5 s and one span per request, to a local sink) against the same worker with all of it off "
               "(`--disable-metrics --disable-log-requests`), driven alternately by `fleetllm bench`.", cmd,
               f"- per run (output tok/s): {runs}\n- {summary}\n")


if __name__ == "__main__":
    sys.exit(main())
