"""Which weight format is fastest for each batch width: a micro-benchmark of CPU linear kernels.

Times one linear layer of SmolLM2-135M's shapes (qkv, o, gate_up, down, LM head) at several row counts
(tokens in a step) for each candidate kernel, against fp32 ``F.linear``, and prints the speed-up and
the relative error of each. The engine's ``--quantization`` regimes (see fleetllm/models/quant.py) were
chosen from this table. Each figure is the best of several trials (robust to other load on the machine).

    python benchmarks/quant_kernels.py [--threads 2] [--rows 1,8,32,64,256,1000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.models.quant import Int4Linear, Int8DynamicLinear, Int8Linear

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}


def best_ms(fn: Callable[[], object], trials: int = 15, budget_s: float = 0.01) -> float:
    """Best per-call milliseconds over ``trials`` runs of about ``budget_s`` each."""
    fn()
    t = time.perf_counter()
    fn()
    reps = max(1, int(budget_s / max(time.perf_counter() - t, 1e-6)))
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def candidates(lin: nn.Linear) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each kernel as a function of the activations (every path forced, whatever the row count)."""
    w = lin.weight
    wb = w.bfloat16()
    int4 = Int4Linear(lin, max_rows=1 << 30)
    wo8 = Int8Linear(lin, max_rows=1 << 30)
    dyn = Int8DynamicLinear(lin)
    return {
        "int4 w-only": int4,
        "int8 w-only": wo8,
        "int8 dynamic": dyn,
        "bf16": lambda x: F.linear(x.bfloat16(), wb).float(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32,64,256,1000")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; speed-up over fp32 (relative error)")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        lin = nn.Linear(k, n, bias=False).requires_grad_(False)
        lin.weight.normal_(0, 0.05)
        cands = candidates(lin)
        print(f"\n| {name} {k}→{n} | rows | fp32 ms | " + " | ".join(cands) + " |")
        print("|---|---:|---:|" + "---:|" * len(cands))
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            with torch.inference_mode():
                ref = F.linear(x, lin.weight)
                t32 = best_ms(lambda x=x, w=lin.weight: F.linear(x, w))
                cells = []
                for fn in cands.values():
                    err = ((fn(x) - ref).norm() / ref.norm()).item()
                    cells.append(f"{t32 / best_ms(lambda fn=fn, x=x: fn(x)):.2f}× ({err:.3f})")
            print(f"| | {rows} | {t32:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
