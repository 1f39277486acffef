"""The Q4_1 C kernels against fp32 ``F.linear``, per SmolLM2-135M shape: fp32 activations (``q4_gemv.c``), and
int16 (``q4``'s) or int8 (``q4-q8``'s) activations with integer dot products (``q4_int_gemm.c``); and the bf16
kernel ``q4`` takes for wide steps (``bf16_gemm.c``: the same weights rounded to bf16, AVX-512 BF16).

Each shape gets 30 distinct weights (one per layer, as a decode step reads them: together they do not fit
in the caches) and a call cycles through them, so the figures are main-memory ones. Per shape and row
count M: µs per call (best of the rounds), the ratios, and the integer kernels' largest difference from fp32
``F.linear`` relative to the output's scale (the weights are the same numbers: only the activations' rounding).
Then the LM head (49152×576, one weight: 113 MB in fp32, larger than any cache) fp32 against the Q8_0
kernel (``fleetllm/kernels/q8_gemv.c``: a byte a weight plus 4 bytes of d per 32) and the bf16 one.

    python benchmarks/q4_gemv.py [--rows 1,2,4,8] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetllm.kernels import bf16, q4, q4_int, q8  # noqa: E402

LAYERS = 30
HEAD = (49152, 576)  # SmolLM2's LM head, tied to the embedding, Q8_0 in the GGUF
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # fused, as run


def random_q4(n: int, k: int) -> q4.Q4Weight:
    """A random Q4_1 weight with GGUF-like scales (fp16-rounded d and m)."""
    groups = k // q4.GROUP
    levels = torch.randint(0, 16, (n, groups, 32), dtype=torch.uint8)
    packed = torch.cat([levels[..., :8] | (levels[..., 8:16] << 4), levels[..., 16:24] | (levels[..., 24:] << 4)], -1)
    d = (torch.rand(n, groups) * 0.01 + 1e-3).half().float()
    m = (-8 * d - torch.rand(n, groups) * 1e-3).half().float()
    return q4.Q4Weight(packed.contiguous(), d, m)


def time_cycle(fn: Callable[[int], object], rounds: int) -> tuple[float, float]:
    """(min, median) µs of one call, each round calling ``fn`` once per layer."""
    for i in range(LAYERS):
        fn(i)
    per_call = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(LAYERS):
            fn(i)
        per_call.append((time.perf_counter() - t) * 1e6 / LAYERS)
    return min(per_call), statistics.median(per_call)


def bench_shape(name: str, n: int, k: int, rows: list[int], rounds: int) -> dict[int, list[float]]:
    """Print one table row per M for this shape; return {M: [fp32, Q4·fp32, Q4·int16, Q4·int8, bf16] µs} (min over
    rounds; Q4·fp32 only up to 48 rows, where the decode stack used it, else NaN)."""
    qw = [random_q4(n, k) for _ in range(LAYERS)]
    bw = [q4_int.BlockedQ4.of(w) for w in qw]
    fw = [w.dequantize() for w in qw]
    pw = [bf16.PairedBF16.of(w) for w in fw]
    out = {}
    for m in rows:
        x = torch.randn(m, k)
        ref = torch.nn.functional.linear(x, fw[0])
        times = [time_cycle(lambda i, x=x: torch.nn.functional.linear(x, fw[i]), rounds)[0],
                 time_cycle(lambda i, x=x: q4.q4_linear(x, qw[i]), rounds)[0] if m <= 48 else float("nan")]
        errs = []
        for bits in (16, 8):
            times.append(time_cycle(lambda i, x=x, bits=bits: q4_int.q4_int_linear(x, bw[i], bits=bits), rounds)[0])
            errs.append(((q4_int.q4_int_linear(x, bw[0], bits=bits) - ref).abs().max() / ref.abs().max()).item())
        times.append(time_cycle(lambda i, x=x: bf16.bf16_linear(x, pw[i]), rounds)[0])
        errs.append(((bf16.bf16_linear(x, pw[0]) - ref).abs().max() / ref.abs().max()).item())
        f, q, i16, i8, b16 = times
        print(f"| {name} | {n}×{k} | {m} | {f:.1f} | {q:.1f} | {i16:.1f} | {i8:.1f} | {b16:.1f} | {f / i16:.2f}× | "
              f"{q / i16:.2f}× | {q / i8:.2f}× | {i16 / b16:.2f}× | {errs[0]:.1e} | {errs[1]:.1e} | {errs[2]:.1e} |")
        out[m] = times
    return out


def bench_head(rows: list[int], rounds: int) -> None:
    """Print one table row per M for the LM head: fp32 ``F.linear`` against the Q8_0 kernel."""
    n, k = HEAD
    levels = torch.randint(-127, 128, (n, k // q8.GROUP, q8.GROUP), dtype=torch.int8)
    d = (torch.rand(n, k // q8.GROUP) * 0.002 + 1e-5).half().float()
    qw = q8.Q8Weight(levels.reshape(n, k).contiguous(), d)
    fw = qw.dequantize()
    pw = bf16.PairedBF16.of(fw)
    fp32_bytes, q8_bytes = n * k * 4, n * k + n * (k // q8.GROUP) * 4
    print("\n| GEMV | N×K | M | fp32 µs | fp32 GB/s | Q8 µs | Q8 GB/s | Q8 vs fp32 | bf16 µs | bf16 vs Q8 | "
          "max rel diff Q8 | bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in rows:
        x = torch.randn(m, k)
        f_min, f_med = time_cycle(lambda i, x=x: torch.nn.functional.linear(x, fw), rounds)
        q_min, q_med = time_cycle(lambda i, x=x: q8.q8_linear(x, qw), rounds)
        ref = torch.nn.functional.linear(x, fw)
        b_min, b_med = time_cycle(lambda i, x=x: bf16.bf16_linear(x, pw), rounds)
        errs = [((y - ref).abs().max() / ref.abs().max()).item() for y in (q8.q8_linear(x, qw), bf16.bf16_linear(x, pw))]
        print(f"| lm_head | {n}×{k} | {m} | {f_min:.0f} ({f_med:.0f}) | {fp32_bytes / f_min / 1e3:.1f} | "
              f"{q_min:.0f} ({q_med:.0f}) | {q8_bytes / q_min / 1e3:.1f} | {f_min / q_min:.2f}× | {b_min:.0f} ({b_med:.0f}) | "
              f"{q_min / b_min:.2f}× | {errs[0]:.1e} | {errs[1]:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8", help="comma-separated row counts M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="timed cycles over the 30 layers' weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = (q4, q8, q4_int, bf16)
    if not all(kernel.kernel_ready(wait=True) for kernel in kernels):
        sys.exit(f"a kernel is unavailable (bf16 needs AVX-512 BF16): {[k.LIBRARY.error for k in kernels]}")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.1f}, µs per call: min (median) of {args.rounds} "
          f"rounds over {LAYERS} distinct weights\n")
    print("| GEMM | N×K | M | fp32 µs | Q4·fp32 µs | Q4·int16 µs | Q4·int8 µs | bf16 µs | int16 vs fp32 | "
          "int16 vs Q4·fp32 | int8 vs Q4·fp32 | bf16 vs int16 | max rel diff int16 | int8 | bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals = {m: [0.0] * 5 for m in rows}
    for name, (n, k) in SHAPES.items():
        for m, times in bench_shape(name, n, k, rows, args.rounds).items():
            totals[m] = [t + v * LAYERS / 1e3 for t, v in zip(totals[m], times, strict=True)]
    for m, (f, q, i16, i8, b16) in totals.items():
        print(f"decoder linears of one step, M={m}: fp32 {f:.2f} ms, Q4·fp32 {q:.2f}, Q4·int16 {i16:.2f} "
              f"({f / i16:.2f}× fp32, {q / i16:.2f}× Q4·fp32), Q4·int8 {i8:.2f} ({q / i8:.2f}× Q4·fp32), "
              f"bf16 {b16:.2f} ({i16 / b16:.2f}× Q4·int16, {f / b16:.2f}× fp32)")
    bench_head(rows, args.rounds)


if __name__ == "__main__":
    main()
