"""`fleetllm recommend`'s decode tok/s for a mixture of experts against a worker's, on this CPU.

The model: the realistic-shape random-initialised Qwen3-MoE of benchmarks/moe_vs_hf.py (hidden 1024, 64 experts of
512, top 8, 16 layers, SmolLM2's 49k vocabulary: 1.70 B parameters, 0.29 B active) as llama.cpp's converter writes it
in Q8_0, served under fleetllm's default quantization (its experts stay Q8_0).

Predicted: the step model `fleetllm recommend` uses for this machine (``local-cpu``), for the GGUF's shape, from each
timing profile given (``fleetllm calibrate`` outputs; ``--calibrate MODEL`` measures one first): decode tok/s at
concurrency c = c / step(c decoding sequences at the run's mean context). A profile of another model is scaled by
active parameters, plus the expert reads a step's tokens add (perf_model.Measured); a profile of this GGUF is used as
measured. Measured: ``fleetllm worker`` (one thread, as a profile is) serving c streamed completions of ``--new``
tokens at once, decode tok/s = tokens after each request's first / (last token - first token), summed over the c
requests; the best of ``--rounds``.

    flock /tmp/fleetllm-bench.lock python benchmarks/recommender_moe.py --calibrate smollm2-135m --calibrate-gguf
    python benchmarks/recommender_moe.py --gguf /tmp/moe-q8_0.gguf --profile /tmp/smol.json --profile /tmp/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from common import free_ports, stop_process, wait_healthy

from fleetllm.models.source import cache_dir
from fleetllm.recommend.catalogue import load_catalogue, with_profile
from fleetllm.recommend.model_shape import load_shape
from fleetllm.recommend.search import step_model

PROMPT = 16  # tokens of each request's prompt
CONCURRENCY = (1, 8)


def realistic_gguf() -> Path:
    """The realistic-shape model's Q8_0 GGUF, built once per machine (HF model ~7 GB in fp32 while building)."""
    target = cache_dir() / "bench" / "qwen3-moe-h1024-e64x512-k8-l16-q8_0.gguf"
    if not target.exists():
        from moe_vs_hf import build, convert

        target.parent.mkdir(parents=True, exist_ok=True)
        shape = argparse.Namespace(hidden=1024, experts=64, expert_width=512, top_k=8, layers=16)
        with tempfile.TemporaryDirectory() as d:
            build(shape, d)
            os.replace(convert(d, "q8_0"), target)
    return target


def calibrate(model: str, out: Path) -> Path:
    """``fleetllm calibrate --model MODEL`` (one thread, 3 sweeps) into ``out``."""
    subprocess.run([sys.executable, "-m", "fleetllm.cli", "calibrate", "--model", model, "--output", str(out)],
                   check=True)
    return out


def predicted(gguf: Path, profile: Path, c: int, context: int) -> float:
    """Decode tok/s at concurrency ``c`` by recommend's step model of this machine timed by ``profile``."""
    cat = with_profile(load_catalogue(), str(profile))
    step = step_model(load_shape(str(gguf)), cat.instance("local-cpu"), cat.formats["fp32"], 1, None)  # type: ignore[arg-type]
    return c / step.step_seconds(c, 0, c * context)


def _stream(base: str, prompt: list[int], new: int) -> tuple[float, float, int]:
    """One streamed completion: (first token's time, last token's time, tokens)."""
    body = {"model": "moe", "prompt": prompt, "max_tokens": new, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times[0], times[-1], len(times)


def measured(base: str, c: int, new: int, rounds: int) -> float:
    """Decode tok/s of ``c`` concurrent requests (each a prompt of its own), the best of ``rounds``."""
    best = 0.0
    for r in range(rounds):
        prompts = [[100 + 7 * (r * c + i) + t for t in range(PROMPT)] for i in range(c)]
        with ThreadPoolExecutor(c) as pool:
            done = list(pool.map(lambda p: _stream(base, p, new), prompts))
        best = max(best, sum((n - 1) / (last - first) for first, last, n in done))
    return best


def measure_worker(gguf: Path, new: int, rounds: int) -> dict[int, float]:
    port = free_ports(1)
    cmd = [sys.executable, "-m", "fleetllm.cli", "worker", "--model", str(gguf), "--served-model-name", "moe",
           "--num-threads", "1", "--port", str(port), "--log-level", "warning", "--kv-cache-gb", "0.5"]
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "worker.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(f"{base}/health", proc, log, timeout=900)
            _stream(base, list(range(50, 50 + PROMPT)), 4)  # warm-up: the mapped weights read once
            return {c: measured(base, c, new, rounds) for c in CONCURRENCY}
        finally:
            stop_process(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="the model (default: the realistic shape, built once per machine)")
    ap.add_argument("--profile", type=Path, action="append", default=[], help="a `fleetllm calibrate` output")
    ap.add_argument("--calibrate", action="append", default=[], help="calibrate this model first (e.g. smollm2-135m)")
    ap.add_argument("--calibrate-gguf", action="store_true", help="calibrate the GGUF itself first")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    gguf = args.gguf or realistic_gguf()
    work = Path(tempfile.mkdtemp(prefix="recommender-moe-"))  # the profiles calibrated here, kept for --profile
    profiles = list(args.profile)
    for i, model in enumerate(args.calibrate + ([str(gguf)] if args.calibrate_gguf else [])):
        profiles.append(calibrate(model, work / f"profile-{i}.json"))
    load = os.getloadavg()[0]
    got = measure_worker(gguf, args.new, args.rounds)
    context = PROMPT + args.new // 2
    rows = []
    for profile in profiles:
        source = json.loads(profile.read_text())["model"]
        for c in CONCURRENCY:
            p = predicted(gguf, profile, c, context)
            rows.append({"profile": source, "c": c, "predicted_tok_s": p, "measured_tok_s": got[c], "ratio": p / got[c]})
    print(f"{gguf.name}: {load_shape(str(gguf)).params / 1e9:.2f} B params, "
          f"{load_shape(str(gguf)).active_params / 1e9:.2f} B active; worker 1 thread, {args.new} new tokens, "
          f"load {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    for r in rows:
        print(f"profile of {Path(r['profile']).name:<44} c={r['c']}: predicted {r['predicted_tok_s']:6.1f} tok/s, "
              f"measured {r['measured_tok_s']:6.1f} tok/s, predicted/measured {r['ratio']:.2f}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
