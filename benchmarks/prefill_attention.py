"""Prefill attention read in place (``fleetllm/kernels/prefill_attention.c``) against gather + SDPA, one layer.

SmolLM2-135M's attention shape (9 heads, 3 KV heads, head_dim 64), a paged fp32 cache of 16-token blocks, on
``--threads`` threads. Each case times the model's eager path (SDPA with ``is_causal`` on a fresh chunk; gather
of the context + SDPA with a mask on a chunk over cached context) and the kernel back to back, median of
``--repeats``, and prints the ratio and the kernel's GMAC/s (causal pairs x head_dim x 2 per head).

    python benchmarks/prefill_attention.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetllm.kernels.prefill import prefill_attention, prefill_ready  # noqa: E402

BLOCK, HEADS, KV_HEADS, DIM = 16, 9, 3, 64
CASES = [(512, 512), (488, 1000), (512, 2048), (64, 1000), (16, 1000)]  # (queries, context length)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """What ``Attention._prefill`` runs: causal SDPA on a fresh chunk, gather + masked SDPA over cached context."""
    n = q.shape[0]
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = k.index_select(0, torch.arange(n_ctx)).transpose(0, 1).unsqueeze(0)
    vt = v.index_select(0, torch.arange(n_ctx)).transpose(0, 1).unsqueeze(0)
    if n == n_ctx:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=DIM**-0.5, enable_gqa=True)
    mask = torch.arange(n_ctx).unsqueeze(0) <= torch.arange(n_ctx - n, n_ctx).unsqueeze(1)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=DIM**-0.5, enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not prefill_ready(torch.zeros(1, HEADS, DIM), torch.zeros(1, KV_HEADS, DIM), wait=True):
        sys.exit("prefill kernel unavailable on this machine (needs AVX-512F and a C compiler)")
    print(f"| queries | context | SDPA ms | kernel ms | kernel / SDPA speed | kernel GMAC/s |  ({args.threads} threads)")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, n_ctx in CASES:
        blocks = -(-n_ctx // BLOCK)
        k, v = torch.randn(blocks * BLOCK, KV_HEADS, DIM), torch.randn(blocks * BLOCK, KV_HEADS, DIM)
        table, q, out = torch.arange(blocks, dtype=torch.int32), torch.randn(n, HEADS, DIM), torch.empty(n, HEADS, DIM)
        eager = median_ms(lambda: sdpa(q, k, v, n_ctx), args.repeats)  # noqa: B023 - timed at once
        kernel = median_ms(lambda: prefill_attention(q, k, v, table, n_ctx, DIM**-0.5, BLOCK, out=out), args.repeats)  # noqa: B023
        pairs = sum(n_ctx - n + i + 1 for i in range(n))
        gmacs = pairs * HEADS * DIM * 2 / (kernel * 1e-3) / 1e9
        print(f"| {n} | {n_ctx} | {eager:.2f} | {kernel:.2f} | {eager / kernel:.2f}x | {gmacs:.0f} |")


if __name__ == "__main__":
    main()
