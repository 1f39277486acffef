"""Is a fast engine configuration close enough to exact fp32? Greedy agreement and perplexity (issue #19).

    python benchmarks/fast_path_quality.py --engine quantization=int4
    python benchmarks/fast_path_quality.py --engine quantization=none --engine kv_cache_dtype=bf16

``--engine KEY=VALUE`` (repeatable) sets an EngineConfig field (the worker's flag without dashes, ``_``
for ``-``); the reference is the same engine with ``quantization=none`` and nothing else set. Goals:
the first 32 greedy tokens identical for ≥ 14 of the 16 reference prompts (both with every prompt in one
batch and prompt by prompt), perplexity on ~20k tokens of stdlib docstrings within 1% of fp32's.
Exit status 1 when a goal is missed. See fleetllm/bench/quality.py for how each check is made.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from fleetllm.bench.quality import compare, prompt_ids, stdlib_text
from fleetllm.models.loader import load_model


def parse_setting(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE as int, float, bool or str, whichever reads it."""
    key, _, value = item.partition("=")
    if value.lower() in ("true", "false"):
        return key.replace("-", "_"), value.lower() == "true"
    for kind in (int, float):
        try:
            return key.replace("-", "_"), kind(value)
        except ValueError:
            pass
    return key.replace("-", "_"), value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="an EngineConfig setting")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt")
    ap.add_argument("--text-tokens", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=512, help="perplexity: tokens per independent window")
    ap.add_argument("--chunk", type=int, default=512, help="perplexity: tokens per forward (under 8: narrow steps)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-agree", type=int, default=14)
    ap.add_argument("--max-ppl-ratio", type=float, default=1.01)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    settings = dict(parse_setting(s) for s in args.engine)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    prompts = prompt_ids(loaded.tokenizer)
    text = stdlib_text(loaded.tokenizer, args.text_tokens)
    q = compare(loaded, settings, prompts, args.tokens, text, args.window, args.chunk)
    print(f"settings {settings or '(defaults)'} against quantization=none, {args.model}, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}")
    print(f"greedy, first {args.tokens} tokens identical: {q.agree_batched}/{q.prompts} in one batch, "
          f"{q.agree_one_by_one}/{q.prompts} prompt by prompt (goal ≥ {args.min_agree})")
    print(f"perplexity on {q.text_tokens} tokens of stdlib docstrings (sha {q.text_sha}), windows of {args.window}, "
          f"chunks of {args.chunk}: {q.ppl:.4f} vs fp32 {q.ppl_fp32:.4f} = {q.ppl_ratio:.4f}× "
          f"(goal ≤ {args.max_ppl_ratio})")
    ok = min(q.agree_batched, q.agree_one_by_one) >= args.min_agree and q.ppl_ratio <= args.max_ppl_ratio
    print(f"{'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
