"""8-bit KV cache read in place (``--kv-cache-dtype int8 | fp8 | fp8_e5m2``) against fp32 KV, one thread.

Two measurements, every dtype in each round so that the ratios share the machine's load (the best round kept):

* decode attention alone (the paged kernel, ``fleetllm.kernels.attention``) of one query over ``--context``
  positions (default 8,192) in SmolLM2-135M's shape (9 heads, 3 KV heads, head_dim 64), over 30 layers' own
  caches (so that, as in a real step, the cache is read from memory, not from a cache level): ms per layer;
* a whole decode step of SmolLM2-135M with the worker's default ``q4`` (the C decode stack writes the new K/V and
  reads the cache through the same kernel) at 1k / 4k / 8k tokens of context: ms per step and tokens/s;
* a needle in a haystack (quality, two threads): a password sentence put at 10% and 50% of ~6,000 tokens of stdlib
  docstrings, then the question; each dtype's greedy answer, whether it holds the password, and whether it is
  fp32's answer token for token.

The cache holds random K/V (quantised as the engine quantises them): a step's cost does not depend on the values.

    flock /tmp/fleetllm-bench.lock python benchmarks/kv8.py [--contexts 1024 4096 8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save_run  # noqa: E402
from benchmarks.paged_attention import FakeScheduled, FakeSeq  # noqa: E402  (the runner's view of a sequence)
from fleetllm.bench.quality import stdlib_text  # noqa: E402
from fleetllm.engine.llm import LLM  # noqa: E402
from fleetllm.engine.model_runner import KV_DTYPES, ModelRunner  # noqa: E402
from fleetllm.engine.params import SamplingParams  # noqa: E402
from fleetllm.kernels import attention, kv8, wait_for_kernels  # noqa: E402
from fleetllm.models.loader import load_model  # noqa: E402
from fleetllm.models.quant import quantize_model  # noqa: E402

BLOCK = 16
DTYPES = ("fp32", "bf16", "int8", "fp8", "fp8_e5m2")


def filled(rows: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A cache of ``rows`` random K (or V) rows as a pool of ``dtype`` holds them."""
    x = torch.randn(rows, kv_heads, dim)
    return kv8.quantize(x, dtype) if kv8.quantized(dtype) else x.to(dtype)


def best_of(rounds: int, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """The fastest seconds of each run over ``rounds`` rounds, every run once per round (after one warm-up)."""
    best = dict.fromkeys(runs, float("inf"))
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def kernel_alone(context: int, rounds: int) -> str:
    layers, nb = 30, context // BLOCK
    table = torch.randperm(nb).int().view(1, -1)  # blocks in a shuffled order, as a long-lived pool holds them
    lens, q = torch.tensor([context], dtype=torch.int32), torch.randn(1, 9, 64)
    caches = {d: [(filled(nb * BLOCK, 3, 64, KV_DTYPES[d]), filled(nb * BLOCK, 3, 64, KV_DTYPES[d]))
                  for _ in range(layers)] for d in DTYPES}

    def run(d: str) -> None:
        for k, v in caches[d]:
            attention.paged_attention(q, k, v, table, lens, 0.125, BLOCK)

    best = best_of(rounds, {d: (lambda d=d: run(d)) for d in DTYPES})
    out = [f"## decode attention, one query over {context} positions (9 heads, 3 KV heads, d 64), one thread",
           "", "| KV dtype | bytes per token (30 layers) | ms per layer | vs fp32 |", "|---|---|---|---|"]
    for d in DTYPES:
        per_token = ModelRunner.kv_bytes_per_block(_MODEL[0], 1, KV_DTYPES[d]) if _MODEL else 0
        ms = best[d] / layers * 1e3
        out.append(f"| {d} | {per_token:,} | {ms:.3f} | {best['fp32'] / best[d]:.2f}× |")
    return "\n".join(out)


_MODEL: list = []  # the loaded model, for bytes per token


def whole_steps(contexts: list[int], rounds: int) -> str:
    model = quantize_model(_MODEL[0], "q4")
    out = ["## decode step of SmolLM2-135M (q4: the C decode stack), one sequence, one thread", "",
           "| context | " + " | ".join(f"{d} ms (tok/s)" for d in DTYPES) + " | int8 vs fp32 |",
           "|---|" + "---|" * (len(DTYPES) + 1)]
    for ctx in contexts:
        per = -(-(ctx + 1) // BLOCK)
        runners = {}
        for d in DTYPES:
            r = ModelRunner(model, per + 1, BLOCK, kv_dtype=KV_DTYPES[d])
            cfg = model.cfg
            for k, v in r.kv_cache:
                k.copy_(filled(k.shape[0], cfg.num_kv_heads, cfg.head_dim, KV_DTYPES[d]))
                v.copy_(filled(v.shape[0], cfg.num_kv_heads, cfg.head_dim, KV_DTYPES[d]))
            runners[d] = r
        seq = [FakeScheduled(FakeSeq(ctx, list(range(per))))]
        best = best_of(rounds, {d: (lambda r=r, seq=seq: r.execute(seq, [0])) for d, r in runners.items()})
        cells = " | ".join(f"{best[d] * 1e3:.1f} ({1 / best[d]:.0f})" for d in DTYPES)
        out.append(f"| {ctx} | {cells} | {best['fp32'] / best['int8']:.2f}× |")
        del runners
    return "\n".join(out)


NEEDLE, PASSWORD = " The secret password is 7391-PELICAN. Remember it.\n", "7391"
QUESTION = "\n\nQuestion: what is the secret password?\nAnswer: The secret password is"


def needle(haystack: int, depths: list[float]) -> str:
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    hay, pin = stdlib_text(tok, haystack), tok.encode(NEEDLE, add_special_tokens=False)
    ask = tok.encode(QUESTION, add_special_tokens=False)
    out = [f"## needle in a haystack: a password at a depth of ~{haystack:,} tokens, greedy answer (10 tokens)", "",
           "| depth | KV dtype | answer | holds the password | fp32's answer |", "|---|---|---|---|---|"]
    for depth in depths:
        at = int(len(hay) * depth)
        ids = hay[:at] + pin + hay[at:] + ask
        answers = {}
        for d in ("fp32", "int8", "fp8", "fp8_e5m2"):
            # the prompt and its 10 answer tokens, with blocks to spare (the pool keeps a few of its own)
            llm = LLM(loaded=loaded, num_blocks=-(-len(ids) // BLOCK) + 8, kv_cache_dtype=d, max_model_len=len(ids) + 16)
            got = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs[0]
            answers[d] = got.token_ids
            text = tok.decode(got.token_ids).replace("\n", "\\n").replace("|", "\\|")
            out.append(f"| {depth:.0%} of {len(ids):,} | {d} | `{text}` | {'yes' if PASSWORD in text else 'no'} | "
                       f"{'same' if answers[d] == answers['fp32'] else 'differs'} |")
    torch.set_num_threads(1)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192, help="positions of the attention-only measurement")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192], help="whole decode steps")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--haystack", type=int, default=6000, help="needle: tokens of haystack (0: no needle check)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5], help="needle: where it sits")
    args = ap.parse_args()
    torch.set_num_threads(1)
    wait_for_kernels()
    isa = {3: "avx512", 2: "avx2"}.get(attention.LIBRARY.lib.paged_attention_isa(), "scalar")
    _MODEL.append(load_model("smollm2-135m").model)
    load0 = os.getloadavg()[0]
    parts = [kernel_alone(args.context, args.rounds), whole_steps(args.contexts, args.rounds)]
    timings = "\n\n".join(parts)
    print(timings, flush=True)  # before the needle's long prefills
    parts += [needle(args.haystack, args.depths)] if args.haystack else []
    lines = "\n\n".join(parts) + (f"\n\npaged kernel path: {isa}; load average {load0:.2f} at the start, "
                                  f"{os.getloadavg()[0]:.2f} at the end\n")
    print(lines[len(timings):])
    save_run("# 8-bit KV cache", "Decode attention and decode steps with 8-bit KV (int8, fp8) read in place, "
             "against fp32 and bf16 KV; one thread, best of interleaved rounds.",
             "python " + " ".join(sys.argv), lines)


if __name__ == "__main__":
    main()
