"""Cost of inference data capture: a fleet capturing every tier at 100% to S3 (SSE-KMS and envelope
encryption) against the same fleet with capture off, in one run.

What it does:
  1. starts a real S3 + KMS API (``moto_server``) on 127.0.0.1, pinned to the last core where the machine
     has more than one, and a bucket and KMS key in it;
  2. starts two fleets with ``fleetllm serve`` (router + one real SmolLM2 worker each, pinned to the other
     cores): ``off``, and ``on`` = ``--capture-destination s3://... --capture-kms-key-id K --capture-envelope``
     (endpoint, access and worker tiers, 100%);
  3. drives them in turn with ``fleetllm bench`` (streaming chat, closed loop, fixed concurrency and request
     count, exactly ``--osl`` output tokens), alternating off/on for ``--rounds`` rounds so drift in the
     machine's load hits both alike;
  4. prints output-token throughput and TTFT p50 per run, the medians, and the ratios on / off (goals:
     throughput >= 0.95, TTFT p50 <= 1.05); then stops the fleets (SIGTERM flushes) and counts the
     captured endpoint and worker records against the requests sent. ``--record`` saves the run to results/.

Run:  python benchmarks/capture_overhead.py [--concurrency 4 --requests 32 --isl 64 --osl 32 --rounds 3] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_run, stop_process, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def pinned(cmd: list[str], cores: list[int]) -> list[str]:
    """``cmd`` run on ``cores`` only (taskset), where the machine has cores to spare."""
    return ["taskset", "-c", ",".join(map(str, cores)), *cmd] if len(os.sched_getaffinity(0)) > 1 else cmd


def start(cmd: list[str], url: str, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``cmd`` started, once ``url``/health answers."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
    wait_healthy(url, proc, log)
    return proc


def bench(url: str, args: argparse.Namespace, out: Path) -> tuple[float, float, int]:
    cmd = [sys.executable, "-m", "fleetllm.cli", "bench", "--url", url, "--model", "smollm2-135m",
           "--concurrency", str(args.concurrency), "--requests", str(args.requests), "--isl", str(args.isl),
           "--osl", str(args.osl), "--warmup-requests", "2", "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    s = json.loads(out.read_text())["runs"][0]["summary"]
    if s["requests"]["errors"]:
        raise RuntimeError(f"{url}: {s['errors_by_kind']}")
    return float(s["output_token_throughput"]), float(s["metrics"]["ttft_ms"]["p50"]), s["requests"]["total"] + 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="save the run to results/ (for BENCHMARKS.md)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    fleet_cores, s3_cores = (cores[:-1], cores[-1:]) if len(cores) > 1 else (cores, cores)
    tmp = Path(tempfile.mkdtemp(prefix="fleetllm-capture-overhead-"))
    s3_url = "http://127.0.0.1:18720"
    s3_proc = start(pinned([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "18720"], s3_cores),
                    s3_url + "/moto-api/", tmp / "s3.log", {})
    fleets: dict[str, subprocess.Popen[bytes]] = {}
    try:
        import boto3

        boto3.client("s3", endpoint_url=s3_url, **_creds()).create_bucket(Bucket="captures")
        key_id = boto3.client("kms", endpoint_url=s3_url, **_creds()).create_key()["KeyMetadata"]["KeyId"]
        capture = ["--capture-destination", "s3://captures/bench", "--capture-s3-endpoint-url", s3_url,
                   "--capture-kms-key-id", key_id, "--capture-envelope", "--capture-spool-dir", str(tmp / "spool")]
        ports = {"off": 18700, "on": 18710}
        for name, extra in (("off", []), ("on", capture)):
            cmd = [sys.executable, "-m", "fleetllm.cli", "serve", "--replicas", "1", "--num-threads",
                   str(len(fleet_cores)), "--port", str(ports[name]), "--log-dir", str(tmp / name), *extra]
            fleets[name] = start(pinned(cmd, fleet_cores), f"http://127.0.0.1:{ports[name]}/health",
                                 tmp / f"{name}.log", AWS)
        runs, sent = drive(args, ports, tmp)
        for p in fleets.values():
            stop_process(p)  # SIGTERM: the `on` fleet flushes its spool to S3
        counts = captured(s3_url)
    finally:
        for p in fleets.values():
            stop_process(p)
        stop_process(s3_proc)
    cost = record_cost_us()
    summary = _summary(runs, sent, counts) + "; in-process cost per record: " + ", ".join(
        f"{tier} {us:.0f} us" for tier, us in cost.items())
    print(summary)
    if args.record:
        record(args, runs, summary)
    return 0


def drive(args: argparse.Namespace, ports: dict[str, int], tmp: Path) -> tuple[dict[str, list[tuple[float, float]]], int]:
    """Alternate off / on bench runs; (throughput, TTFT p50) per run, and the requests sent to ``on``."""
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    sent = 0
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            tput, ttft, n = bench(f"http://127.0.0.1:{ports[name]}", args, tmp / f"{name}-{r}.json")
            runs[name].append((tput, ttft))
            sent += n if name == "on" else 0
            print(f"round {r + 1} {name:3s}: {tput:7.2f} output tok/s, TTFT p50 {ttft:7.1f} ms", flush=True)
    return runs, sent


def record_cost_us(n: int = 5000) -> dict[str, float]:
    """In-process: microseconds the request path pays per captured record, per tier (sampling, redaction,
    ``json.dumps`` and the spool's ``os.write``; shipping excluded), for a chat request of ~1 KB."""
    from fleetllm.capture.config import CaptureConfig
    from fleetllm.capture.recorder import Capture
    from fleetllm.capture.records import access_record, endpoint_record, payload

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 150}], "max_tokens": 32})
    answer = json.dumps({"object": "chat.completion", "choices": [{"message": {"content": "tok " * 32}}],
                         "usage": {"prompt_tokens": 160, "completion_tokens": 32}})
    with tempfile.TemporaryDirectory() as d:
        cap = Capture(CaptureConfig(destination=d, batch_records=10**9, spool_max_mb=10**4), "bench",
                      ("endpoint", "access"))
        out = {}
        t = time.perf_counter()
        for i in range(n):
            flags: set[str] = set()
            rec = endpoint_record(str(i), time.time(), payload(cap.payload("endpoint", body, flags) or "", "application/json",
                                  "INPUT"), payload(cap.payload("endpoint", answer, flags) or "", "application/json",
                                                    "OUTPUT"), {"status": 200})
            cap.write("endpoint", rec, flags)
        out["endpoint"] = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        for i in range(n):
            cap.write("access", access_record({"request_id": str(i), "status": 200, "path": "/v1/chat/completions"}))
        out["access"] = (time.perf_counter() - t) / n * 1e6
    return out


def _creds() -> dict[str, str]:
    return {"region_name": "us-east-1", "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


def captured(s3_url: str) -> dict[str, int]:
    """Records per tier in the bucket (decrypted through KMS)."""
    from fleetllm.capture.reader import CaptureSource

    os.environ.update(AWS)
    counts: dict[str, int] = {}
    for _, tier, _ in CaptureSource("s3://captures/bench", s3_url).records():
        counts[tier] = counts.get(tier, 0) + 1
    return counts


def _summary(runs: dict[str, list[tuple[float, float]]], sent: int, counts: dict[str, int]) -> str:
    med = {n: (statistics.median(t for t, _ in v), statistics.median(f for _, f in v)) for n, v in runs.items()}
    tput_ratio, ttft_ratio = med["on"][0] / med["off"][0], med["on"][1] / med["off"][1]
    return (f"median output tok/s: off {med['off'][0]:.2f}, on {med['on'][0]:.2f}; ratio on/off {tput_ratio:.3f} "
            f"(goal >= 0.95). TTFT p50 ms: off {med['off'][1]:.1f}, on {med['on'][1]:.1f}; ratio {ttft_ratio:.3f} "
            f"(goal <= 1.05). Captured for {sent} requests sent to `on`: endpoint {counts.get('endpoint', 0)}, "
            f"worker {counts.get('worker', 0)}, access {counts.get('access', 0)} records")


def record(args: argparse.Namespace, runs: dict[str, list[tuple[float, float]]], summary: str) -> None:
    cmd = "python benchmarks/capture_overhead.py " + shlex.join(
        ["--concurrency", str(args.concurrency), "--requests", str(args.requests), "--isl", str(args.isl),
         "--osl", str(args.osl), "--rounds", str(args.rounds)])
    per = " / ".join(f"{n}: " + ", ".join(f"{t:.2f} tok/s @ {f:.0f} ms" for t, f in v) for n, v in runs.items())
    save_run("## Capture overhead", "`fleetllm serve` (router + one SmolLM2 worker) with every capture tier at 100% "
               "to S3 (moto on 127.0.0.1, its own core; SSE-KMS and client-side envelope encryption) against the same "
               "fleet with capture off, driven alternately by `fleetllm bench` (streaming chat).", cmd,
               f"- per run (output tok/s @ TTFT p50): {per}\n- {summary}\n")


if __name__ == "__main__":
    sys.exit(main())
