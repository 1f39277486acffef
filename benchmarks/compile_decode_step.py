"""Prototype for issue 19 item 1: how much of a decode step is dispatch, and does torch.compile remove it?

The decode step of SmolLM2-135M written as one function of fixed-shape tensors (batch ``B``, block tables
padded to a fixed width: the static buckets CUDA graphs would capture), its attention the paged C kernel
registered as a torch custom op (opaque to Dynamo, so the graph does not break at it). The script reports,
in one process:

* eager ms/step of that function (what the engine's step costs without its Python metadata work),
* torch.compile (inductor, CPU C++ backend) compile time per bucket with an empty inductor cache, and
  the compiled ms/step,
* the ATen op count of one eager step (the dispatch the compiled graph replaces).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_decode_step.py [--quant int4] [--batches 1 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetllm.kernels import attention  # noqa: E402
from fleetllm.models.loader import load_model  # noqa: E402
from fleetllm.models.quant import quantize_model  # noqa: E402

BLOCK = 16


@torch.library.custom_op("fleetllm_bench::paged_attention", mutates_args=())
def paged_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
             scale: float, block_size: int) -> torch.Tensor:
    return attention.paged_attention(q.contiguous(), k, v, tables, lens, scale, block_size)


@paged_op.register_fake
def _(q, k, v, tables, lens, scale, block_size):  # noqa: ANN001, ANN202
    return torch.empty_like(q)


def decode_step(model, ids, positions, slots, tables, lens, kv):  # noqa: ANN001, ANN201
    """One decode token per sequence through every layer; K/V written at ``slots``, read through ``tables``."""
    b = ids.shape[0]
    h = model.embed(ids)
    cos, sin = model.rotary.cos[positions].unsqueeze(1), model.rotary.sin[positions].unsqueeze(1)
    for layer, (kc, vc) in zip(model.layers, kv, strict=True):
        a = layer.attn
        qkv = a.qkv(layer.input_norm(h))
        q, k, v = qkv.split([a.h * a.d, a.hkv * a.d, a.hkv * a.d], dim=-1)
        q, k, v = q.view(b, a.h, a.d), k.view(b, a.hkv, a.d), v.view(b, a.hkv, a.d)
        q = q * cos + torch.cat([-q[..., a.d // 2:], q[..., : a.d // 2]], -1) * sin
        k = k * cos + torch.cat([-k[..., a.d // 2:], k[..., : a.d // 2]], -1) * sin
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)
        o = paged_op(q, kc, vc, tables, lens, a.scale, BLOCK)
        h = h + a.o(o.view(b, a.h * a.d))
        h = h + layer.mlp(layer.post_attn_norm(h))
    return model.lm_head(model.norm(h))


def inputs(b: int, ctx: int, max_blocks: int, kv: list) -> tuple:  # noqa: ANN001
    tables = torch.arange(b * max_blocks, dtype=torch.int32).view(b, max_blocks)
    slots = tables[:, ctx // BLOCK].long() * BLOCK + ctx % BLOCK
    return (torch.full((b,), 7), torch.full((b,), ctx), slots, tables, torch.full((b,), ctx + 1, dtype=torch.int32), kv)


def ms_per_step(fn, args: tuple, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def count_ops(model, args: tuple) -> int:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_step(model, *args)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="int4", choices=["none", "int4"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(2)
    attention.kernel_ready(torch.zeros(1), torch.zeros(1), wait=True)
    loaded = load_model("smollm2-135m")
    model = loaded.model
    quantize_model(model, args.quant)
    cfg = model.cfg
    max_blocks = -(-(args.context + 1) // BLOCK) + 1
    n = max(args.batches) * max_blocks * BLOCK
    kv = [(torch.zeros(n, cfg.num_kv_heads, cfg.head_dim), torch.zeros(n, cfg.num_kv_heads, cfg.head_dim))
          for _ in range(cfg.num_layers)]
    print(f"quant {args.quant}; context {args.context}; inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}; "
          f"load {os.getloadavg()[0]:.1f}")
    print("| batch | aten ops/step | eager ms/step | compile s | compiled ms/step | speed-up |\n|---|---|---|---|---|---|")
    for b in args.batches:
        x = inputs(b, args.context, max_blocks, kv)
        with torch.inference_mode():
            eager = ms_per_step(lambda *a: decode_step(model, *a), x, args.repeats)
            ops = count_ops(model, x)
            compiled = torch.compile(decode_step, dynamic=False, fullgraph=True)
            t = time.perf_counter()
            ref = decode_step(model, *x)
            got = compiled(model, *x)
            compile_s = time.perf_counter() - t
            fast = ms_per_step(lambda *a, c=compiled: c(model, *a), x, args.repeats)
        err = (got - ref).abs().max().item()
        print(f"| {b} | {ops} | {eager:.1f} | {compile_s:.0f} | {fast:.1f} | {eager / fast:.2f}× |  (max |Δlogit| {err:.1e})")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
