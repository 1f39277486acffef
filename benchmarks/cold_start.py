"""Cold start of a new worker from the model store: (a) from the source over a throttled link, (b) from the node's
cache, (c) from the cache with the dequantised-weight cache warm; with the phase breakdown.

What it does:
  1. builds two hub repos from the embedded model in a temp dir: ``test/smollm2`` (fp32 HF safetensors,
     0.54 GB) and ``test/smollm2-gguf`` (the Q4_1 GGUF, 98 MB), and serves them from the hub-compatible test
     server (tests/store/hub_server.py) on 127.0.0.1, its downloads throttled to ``--link-mbps`` (50 MB/s,
     shared by all connections, as one link);
  2. for each scenario starts a fresh ``fleetllm worker --model hf://...`` process and measures, from the
     moment it is spawned, the time to the first token of a one-token streamed completion (TTFT of a new
     worker: process start, imports, store, load, warm-up, first request); the phases come from the worker's
     own ``fleetllm_worker_cold_start_seconds{phase}``;
  3. scenarios: ``source`` (empty cache), ``cache`` (the same cache again; and pinned to the commit, as the
     copies of a fleet start: no request to the source), and for the GGUF repo ``source``,
     ``cache`` (dequantised cache empty: the GGUF is dequantised at load) and ``cache+dequant``.
  4. prints a markdown table; ``--output`` writes JSON.

Run:  python benchmarks/cold_start.py [--link-mbps 50] [--repeats 1] [--output /tmp/cold_start.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "store"), str(ROOT / "tests")]
from common import cpu_model, stop_process, tail  # noqa: E402
from fleet_helpers import free_port  # noqa: E402
from hub_server import HubRepo, HubServer, HubState, file_meta  # noqa: E402

HF_COMMIT = "1" * 40
PHASES = ("resolve", "download", "verify", "load", "weight_load", "warm_up", "ready")


def build_repos(tmp: Path) -> dict[str, HubRepo]:
    from fleetllm.models.export_hf import export_hf_dir
    from fleetllm.models.loader import load_model
    from fleetllm.models.source import resolve

    load_model("smollm2-135m")  # fills the dequantised cache, which the HF export shares
    hf = export_hf_dir("smollm2-135m", tmp / "hf")
    gguf = resolve("smollm2-135m")
    commit_hf, commit_gguf = HF_COMMIT, "2" * 40
    for p in [*hf.iterdir(), gguf]:
        file_meta(p)  # the test hub hashes its files once; not part of any worker's cold start
    return {"test/smollm2": HubRepo("test/smollm2", {commit_hf: {p.name: p for p in hf.iterdir()}}, {"main": commit_hf}),
            "test/smollm2-gguf": HubRepo("test/smollm2-gguf", {commit_gguf: {gguf.name: gguf}}, {"main": commit_gguf})}


def phases_of(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("fleetllm_worker_cold_start_seconds{"):
            phase = line.split('phase="', 1)[1].split('"', 1)[0]
            out[phase] = float(line.rsplit(" ", 1)[1])
    return out


def new_worker_ttft(model: str, hub: str, cache: Path, dequant: Path, log: Path) -> dict[str, float]:
    """Spawn a worker on ``model``; seconds from spawn to its first streamed token, and its phases."""
    port = free_port()
    cmd = [sys.executable, "-m", "fleetllm.cli", "worker", "--model", model, "--hf-endpoint", hub, "--cache-dir",
           str(cache), "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "64", "--log-level", "warning"]
    env = {**os.environ, "FLEETLLM_CACHE_DIR": str(dequant), "PYTHONPATH": str(ROOT)}
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited:\n{tail(log)}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        body = {"model": model, "prompt": "The sky is", "max_tokens": 1, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        ttft = time.perf_counter() - t0
        return {"ttft_new_worker": ttft, **phases_of(url)}
    finally:
        stop_process(proc)


def scenarios(tmp: Path) -> list[tuple[str, str, Path, Path]]:
    """(name, model, store cache, dequantised cache): runs in this order share caches on purpose."""
    hf_cache, gguf_cache, dq_empty, dq_warm = (tmp / n for n in ("c-hf", "c-gguf", "dq-empty", "dq-warm"))
    hf, gguf = "hf://test/smollm2", "hf://test/smollm2-gguf"
    return [("a. safetensors fp32, from the source", hf, hf_cache, dq_empty),
            ("b. safetensors fp32, from the cache", hf, hf_cache, dq_empty),
            ("b. safetensors fp32, from the cache, pinned (as `fleetllm serve` starts each copy)", f"{hf}@{HF_COMMIT}",
             hf_cache, dq_empty),
            ("a. GGUF Q4_1, from the source", gguf, gguf_cache, dq_warm),
            ("b. GGUF Q4_1, from the cache (dequantised at load)", gguf, gguf_cache, dq_empty),
            ("c. GGUF Q4_1, from the cache + dequantised cache", gguf, gguf_cache, dq_warm)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--link-mbps", type=float, default=50.0, help="the hub's download speed, MB/s (shared)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fleetllm-cold-start-"))
    hub = HubServer(HubState(build_repos(tmp), throttle_bytes_per_s=args.link_mbps * 1e6)).start()
    results = []
    try:
        for rep in range(args.repeats):
            for name, model, cache, dequant in scenarios(tmp / f"r{rep}"):
                if "dequantised at load" in name:
                    shutil.rmtree(dequant, ignore_errors=True)
                r = new_worker_ttft(model, hub.endpoint, cache, dequant, tmp / "workers.log")
                results.append({"scenario": name, "repeat": rep, **r})
                print(json.dumps(results[-1]), flush=True)
    finally:
        hub.stop()
    print(f"\n{cpu_model()}, hub link {args.link_mbps:g} MB/s\n")
    print("| scenario | TTFT of a new worker | " + " | ".join(PHASES) + " |")
    print("|---|---:|" + "---:|" * len(PHASES))
    for r in results:
        print(f"| {r['scenario']} | {r['ttft_new_worker']:.2f} s | "
              + " | ".join(f"{r.get(p, 0):.2f}" for p in PHASES) + " |")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
