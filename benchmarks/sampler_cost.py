"""The sampler's cost on a 49,152-token vocabulary (SmolLM2's), this checkout against a git revision's
sampler, interleaved in one process (min of ``--repeats`` calls each): greedy, top-k + top-p, top-p alone
and plain temperature, at batch 1 and 32.

Run:  python benchmarks/sampler_cost.py [--baseline 67afcd8] [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fleetllm.engine.sampling import Sampler, SamplingParams

REPO = Path(__file__).resolve().parent.parent
VOCAB = 49152
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "top_k 50 + top_p 0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "temperature 1": SamplingParams(temperature=1.0),
}


def sampler_at(rev: str) -> Sampler:
    """The ``Sampler`` of ``fleetllm/engine/sampling.py`` at ``rev``, loaded as its own module."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:fleetllm/engine/sampling.py"], capture_output=True,
                         text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampling_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sampling_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod.Sampler()


def cost_ms(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    n = logits.shape[0]
    rows = [[] for _ in range(n)]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sampler(logits, [params] * n, [None] * n, rows, rows)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="67afcd8")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    old, new = sampler_at(args.baseline), Sampler()
    print(f"| case | batch | {args.baseline} ms | this checkout ms | speed-up |\n|---|---:|---:|---:|---:|")
    for batch in (1, 32):
        logits = torch.randn(batch, VOCAB) * 3
        for name, params in CASES.items():
            before = cost_ms(old, logits, params, args.repeats)
            after = cost_ms(new, logits, params, args.repeats)
            print(f"| {name} | {batch} | {before:.2f} | {after:.2f} | {before / after:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
