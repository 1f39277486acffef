"""Colocated vs disaggregated prefill/decode on the same cores (issue #6).

A stream of short chat requests (closed loop) runs while long prompts keep arriving (a second closed
loop). Colocated: 3 ``both`` workers behind the KV-aware router. Disaggregated: 1 prefill + 2 decode
workers, the router sending prompts with at least ``--pd-threshold`` uncached tokens to the prefill
worker and their KV to a decode worker. Every worker gets one torch thread; the fleets run one after
the other on the same machine. Reported: the short requests' ITL p99 (vLLM ITL: every gap between
tokens) and TTFT p99, both streams' throughput, and a threshold sweep (long prompts of mixed lengths)
showing where disaggregation stops paying. Then the KV transfer itself: frame bytes per second over
HTTP and over shared memory into a real decode worker, against a plain memory copy of the same bytes.

    python benchmarks/disaggregation.py              # full run (BENCHMARKS.md)
    python benchmarks/disaggregation.py --quick      # short smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402

from fleetllm.disagg import frame  # noqa: E402
from fleetllm.disagg.routes import SHM_DIR  # noqa: E402
from fleetllm.engine.block_pool import hash_prefix_blocks  # noqa: E402
from fleetllm.fleet.config import FleetConfig, WorkerGroup  # noqa: E402
from fleetllm.fleet.launcher import Fleet  # noqa: E402

PORT = 19000 + (os.getpid() % 300) * 20


def bench(url: str, out: Path, flags: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "fleetllm.cli", "bench", "--url", url, "--model", "smollm2-135m", "--no-progress",
           "--timeout", "900", "--output", str(out), *flags]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run_fleet(name: str, groups: list[WorkerGroup], threshold: int | None, args: argparse.Namespace,
              long_flags: list[str], out_dir: Path) -> dict:
    cfg = FleetConfig(port=PORT, policy="kv_aware", workers=groups, pd_threshold=threshold,
                      log_dir=str(out_dir / "logs" / name))
    fleet = Fleet(cfg)
    fleet.start()
    try:
        short_out, long_out = out_dir / f"{name}-short.json", out_dir / f"{name}-long.json"
        short = bench(fleet.url, short_out, ["--isl", "48", "--osl", str(args.short_osl), "--concurrency",
                                             str(args.short_concurrency), "--duration", str(args.duration),
                                             "--seed", "3"])
        time.sleep(1.0)  # short traffic first, then the long prompts start arriving
        long = bench(fleet.url, long_out, [*long_flags, "--concurrency", "1", "--duration", str(args.duration - 2),
                                           "--seed", "4"])
        for p in (short, long):
            _, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"bench failed: {err.decode()[-2000:]}")
        pd = {}
        for line in httpx.get(fleet.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("fleetllm_router_pd_decisions_total{"):
                pd[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    finally:
        fleet.stop()
    s = json.loads(short_out.read_text())["runs"][0]["summary"]
    lg = json.loads(long_out.read_text())["runs"][0]["summary"]
    return {"fleet": name, "threshold": threshold, "short_itl_p99_ms": s["metrics"]["chunk_gap_ms"]["p99"],
            "short_itl_p50_ms": s["metrics"]["chunk_gap_ms"]["p50"], "short_ttft_p99_ms": s["metrics"]["ttft_ms"]["p99"],
            "short_req_s": s["request_throughput"], "short_out_tok_s": s["output_token_throughput"],
            "long_req_s": lg["request_throughput"], "long_ttft_p50_ms": lg["metrics"]["ttft_ms"]["p50"],
            "total_out_tok_s": s["output_token_throughput"] + lg["output_token_throughput"],
            "errors": s["requests"]["errors"] + lg["requests"]["errors"], "pd_decisions": pd}


def transfer_throughput(num_blocks: int, repeats: int, out_dir: Path) -> dict:
    """Frame bytes/s into a real decode worker over HTTP and shm, and a memory copy of the same bytes."""
    groups = [WorkerGroup(replicas=1, role="decode", threads=1)]
    fleet = Fleet(FleetConfig(port=PORT, workers=groups, log_dir=str(out_dir / "logs" / "transfer")))
    fleet.start()
    url = fleet.worker_urls[0]
    try:
        results: dict[str, list[float]] = {"http": [], "shm": [], "memcpy": [], "encode+decode": []}
        nbytes = 0
        for r in range(repeats):
            tokens = [(r * 7919 + i * 31) % 40000 + 100 for i in range(num_blocks * 16)]  # fresh blocks each time
            hashes = hash_prefix_blocks(tokens, 16, b"smollm2-135m")
            header = frame.FrameHeader("smollm2-135m", 30, 3, 64, "float32", 16, tokens, hashes)
            layers = [(torch.randn(num_blocks, 16, 3, 64), torch.randn(num_blocks, 16, 3, 64)) for _ in range(30)]
            t0 = time.perf_counter()
            data = b"".join(frame.encode(header, layers))
            frame.decode(data)
            results["encode+decode"].append(time.perf_counter() - t0)
            nbytes = len(data)
            src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            t0 = time.perf_counter()
            src.clone()
            results["memcpy"].append(time.perf_counter() - t0)
            for via in ("http", "shm"):
                if via == "shm":
                    tokens2 = [t + 1 for t in tokens]
                    header.token_ids, header.block_hashes = tokens2, hash_prefix_blocks(tokens2, 16, b"smollm2-135m")
                    d = b"".join(frame.encode(header, layers))
                    path = SHM_DIR / f"fleetllm-kv-{uuid.uuid4().hex}"
                    t0 = time.perf_counter()
                    path.write_bytes(d)
                    resp = httpx.post(url + "/pd/kv", json={"shm": str(path)}, timeout=120)
                else:
                    t0 = time.perf_counter()
                    resp = httpx.post(url + "/pd/kv", content=data, headers={"content-type": "application/octet-stream"},
                                      timeout=120)
                results[via].append(time.perf_counter() - t0)
                assert resp.status_code == 200 and resp.json()["imported"] > 0, resp.text
    finally:
        fleet.stop()
    best = {k: min(v) for k, v in results.items()}
    return {"bytes": nbytes, "blocks": num_blocks, **{f"{k}_GBps": nbytes / v / 1e9 for k, v in best.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of traffic per fleet")
    ap.add_argument("--long-isl", type=int, default=2048)
    ap.add_argument("--short-concurrency", type=int, default=4)
    ap.add_argument("--short-osl", type=int, default=48)
    ap.add_argument("--pd-threshold", type=int, default=1024)
    ap.add_argument("--sweep", default="256,768,1536,4096", help="thresholds for the mixed-length sweep ('' skips)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/disaggregation")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.long_isl, args.sweep = 40.0, 1024, ""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(width=170)
    long_flags = ["--isl", str(args.long_isl), "--osl", "8"]
    colocated = [WorkerGroup(replicas=3, threads=1)]
    disagg = [WorkerGroup(replicas=1, role="prefill", threads=1), WorkerGroup(replicas=2, role="decode", threads=1)]
    rows = []
    console.print(f"colocated (3 both) vs disaggregated (1 prefill + 2 decode), {args.duration:.0f}s each ...")
    rows.append(run_fleet("colocated", colocated, None, args, long_flags, out_dir))
    rows.append(run_fleet("disaggregated", disagg, args.pd_threshold, args, long_flags, out_dir))
    mixed = ["--isl-osl-mix", f"{args.long_isl // 4}:8:1,{args.long_isl // 2}:8:1,{args.long_isl}:8:1"]
    for t in [int(x) for x in args.sweep.split(",") if x]:
        rows.append(run_fleet(f"sweep-{t}", disagg, t, args, mixed, out_dir))
    transfer = transfer_throughput(128, 2 if args.quick else 3, out_dir)

    t = Table(title="short requests while long prompts arrive (ITL = every token gap, vLLM's definition)")
    for c in ("fleet", "threshold", "ITL p50 ms", "ITL p99 ms", "TTFT p99 ms", "short req/s", "out tok/s (all)",
              "long req/s", "P/D decisions", "errors"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["fleet"], str(r["threshold"] or "-"), f"{r['short_itl_p50_ms']:.0f}", f"{r['short_itl_p99_ms']:.0f}",
                  f"{r['short_ttft_p99_ms']:.0f}", f"{r['short_req_s']:.2f}", f"{r['total_out_tok_s']:.1f}",
                  f"{r['long_req_s']:.3f}", json.dumps(r["pd_decisions"]), str(r["errors"]))
    console.print(t)
    co, di = rows[0], rows[1]
    itl_ratio = co["short_itl_p99_ms"] / di["short_itl_p99_ms"]
    thr_ratio = di["total_out_tok_s"] / co["total_out_tok_s"]
    verdicts = [
        f"short-request ITL p99 {itl_ratio:.2f}x lower disaggregated (goal >= 2x: {'met' if itl_ratio >= 2 else 'not met'})",
        f"output throughput disaggregated/colocated x{thr_ratio:.2f} (goal >= 1: {'met' if thr_ratio >= 0.98 else 'not met'})",
        f"KV transfer of {transfer['bytes'] / 1e6:.0f} MB ({transfer['blocks']} blocks): HTTP {transfer['http_GBps']:.2f} GB/s, "
        f"shm {transfer['shm_GBps']:.2f} GB/s, encode+decode {transfer['encode+decode_GBps']:.2f} GB/s, "
        f"memcpy {transfer['memcpy_GBps']:.2f} GB/s (HTTP at {transfer['http_GBps'] / transfer['memcpy_GBps']:.1%} "
        f"of memcpy, shm at {transfer['shm_GBps'] / transfer['memcpy_GBps']:.1%})",
    ]
    for v in verdicts:
        console.print(v)
    (out_dir / "disaggregation.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(), "rows": rows, "transfer": transfer,
         "verdicts": verdicts, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2))
    console.print(f"wrote {out_dir / 'disaggregation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
