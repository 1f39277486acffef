"""Decode tok/s at several concurrencies and prefill tok/s of a long prompt, per ``--quantization``, vs HF.

Everything runs in this process over one set of loaded weights (no HTTP): fleetllm's ``LLM`` for each
quantization method, then HF transformers' batched greedy ``generate`` on fp32 weights dequantised from
the same GGUF, each given the same ``--threads``. Decode: waves of c chat prompts (the prompts of
benchmarks/engine_vs_peers.py), ``--max-tokens`` each with ``ignore_eos``; tok/s = output tokens over wall
time (prefill included). Prefill: one prompt of ``--prefill-tokens`` tokens, one output token; tok/s =
prompt tokens over that wall time (fleetllm prefills in chunks of ``max_num_batched_tokens``).

    python benchmarks/engine_quant_speed.py [--methods none,int4] [--concurrency 1,8,32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from engine_vs_peers import MODEL_ALIAS, _chat, prompt_for

from fleetllm import LLM, SamplingParams
from fleetllm.bench.quality import stdlib_text
from fleetllm.models.loader import load_model, resolve


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn()
    return time.perf_counter() - t, n


def bench_fleetllm(loaded, method: str, args: argparse.Namespace, long_prompt: list[int]) -> dict[str, float]:
    llm = LLM(loaded=loaded, quantization=method, max_num_seqs=max(args.concurrency))
    tok = loaded.tokenizer

    def run(texts: list[str] | list[list[int]], n: int) -> int:
        ids = [t if isinstance(t, list) else tok.encode(tok.apply_chat_template(_chat(t)), add_special_tokens=False)
               for t in texts]
        res = llm.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return sum(len(r.outputs[0].token_ids) for r in res)

    return measure(run, args, long_prompt)


def bench_hf(args: argparse.Namespace, long_prompt: list[int]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve(MODEL_ALIAS)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    def run(texts: list[str] | list[list[int]], n: int) -> int:
        if isinstance(texts[0], list):
            batch = {"input_ids": torch.tensor(texts), "attention_mask": torch.ones(len(texts), len(texts[0]), dtype=torch.long)}
        else:
            chats = [tok.apply_chat_template(_chat(t), tokenize=False, add_generation_prompt=True) for t in texts]
            batch = tok(chats, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        return (out[:, batch["input_ids"].shape[1]:] != tok.pad_token_id).sum().item()

    return measure(run, args, long_prompt)


def measure(run: Callable[[list, int], int], args: argparse.Namespace, long_prompt: list[int]) -> dict[str, float]:
    """tok/s per concurrency (``c=N``) and prefill tok/s of the long prompt (``prefill``)."""
    out: dict[str, float] = {}
    run([prompt_for(9_999)], 4)  # warm-up
    for c in args.concurrency:
        run([prompt_for(10_000 + i) for i in range(c)], 4)
        wall, made = timed(lambda c=c: run([prompt_for(c * 100 + i) for i in range(c)], args.max_tokens))
        out[f"c={c}"] = made / wall
        print(f"    c={c}: {made / wall:.1f} tok/s", flush=True)
    # each round's prompt differs in its first token: a repeated prompt would be served from the prefix cache
    best = min(timed(lambda r=r: run([[long_prompt[0] + 1 + r, *long_prompt[1:]]], 1))[0]
               for r in range(args.prefill_rounds))
    out["prefill"] = len(long_prompt) / best
    print(f"    prefill {len(long_prompt)} tokens: {out['prefill']:.0f} tok/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,int4")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--prefill-rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    torch.set_num_threads(args.threads)
    loaded = load_model(MODEL_ALIAS)
    long_prompt = stdlib_text(loaded.tokenizer, args.prefill_tokens)
    rows: dict[str, dict[str, float]] = {}
    for method in args.methods.split(","):
        print(f"  fleetllm --quantization {method}", flush=True)
        rows[f"fleetllm {method}"] = bench_fleetllm(loaded, method, args, long_prompt)
    if not args.skip_hf:
        print("  hf transformers (fp32)", flush=True)
        rows["hf"] = bench_hf(args, long_prompt)
    cols = [f"c={c}" for c in args.concurrency] + ["prefill"]
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; {args.threads} threads, {args.max_tokens} tokens "
          f"per request, prefill of {len(long_prompt)} tokens")
    print("| system | " + " | ".join(f"{c} tok/s" for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, r in rows.items():
        vs_hf = "hf" in rows and name != "hf"
        print(f"| {name} | " + " | ".join(f"{r[c]:.1f}" + (f" ({r[c] / rows['hf'][c]:.2f}× HF)" if vs_hf else "")
                                        for c in cols) + " |")


if __name__ == "__main__":
    main()
