"""Where a narrower KV cache's error comes from: K or V, and how fine its scales must be (docs/kv-cache-dtype.md).

Each choice is measured without a kernel for it: the op-by-op ``q4`` path (no C decode step, which writes the
cache itself) with an fp32 pool, whose K and/or V rows are rounded as the format would round them as they are
written. Reported per choice: the KL divergence of the next-token distribution from the same path with
unrounded K/V (mean over the positions of ``--text-tokens`` of stdlib docstrings, windows of 512), the share of
positions whose top token changes, and the greedy agreement of the 16 reference prompts (32 tokens, in one batch
and prompt by prompt) with exact fp32.

    python benchmarks/kv8_error.py --choices f/f,r/r,r16/r16,b/b

A choice is ``K/V``, each ``f`` (fp32), ``b`` (bf16), ``r`` (int8, a scale per row), ``rN`` (int8, a scale per
N channels), ``hN`` (int8, a float16 scale per N channels: ``h8`` is as many bytes as ``r16``) or ``aN``
(asymmetric: 255 levels between a group's minimum and maximum, both float16, per N channels).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetllm.bench.quality import greedy, prompt_ids, stdlib_text  # noqa: E402
from fleetllm.kernels import decode_stack, kv8, wait_for_kernels  # noqa: E402
from fleetllm.models.loader import load_model  # noqa: E402

WINDOW = 512


def rounded(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x [..., D]`` as the format ``how`` (see the module's docstring) would give it back."""
    if how == "f":
        return x
    if how == "b":
        return x.bfloat16().float()
    group = x.shape[-1] if how == "r" else int(how[1:])
    g = x.float().unflatten(-1, (-1, group))
    if how[0] == "a":
        low = g.amin(-1, keepdim=True).half().float()
        scale = ((g.amax(-1, keepdim=True) - low) / 255).half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (((g - low) / scale).clamp(0, 255).round() * scale + low).flatten(-2)
    scale = g.abs().amax(-1, keepdim=True) / 127
    if how[0] == "h":
        scale = scale.half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((g / scale).clamp(-127, 127).round() * scale).flatten(-2)


class Rounding:
    """Wraps ``kv8.store``: the layers' writes alternate K then V, each rounded as the current choice says."""

    def __init__(self) -> None:
        self.k, self.v, self.calls = "f", "f", 0
        self.store = kv8.store
        kv8.store = self

    def __call__(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        how = self.k if self.calls % 2 == 0 else self.v
        self.calls += 1
        self.store(cache, slots, rounded(x, how))


def log_probs(loaded: Any, ids: list[int], rounding: Rounding) -> torch.Tensor:
    """Next-token log-probabilities at every position of ``ids``, window by window, through the engine's runner."""
    from fleetllm.engine.config import EngineConfig
    from fleetllm.engine.model_executor import ModelExecutor
    from fleetllm.engine.params import SamplingParams
    from fleetllm.engine.scheduler import Scheduled
    from fleetllm.engine.sequence import Sequence

    cfg = EngineConfig(num_blocks=WINDOW // 16 + 2, kv_cache_dtype="fp32")
    runner = ModelExecutor(cfg, loaded).runner
    out = []
    for w0 in range(0, len(ids) - 1, WINDOW):
        win = ids[w0 : w0 + WINDOW]
        seq = Sequence(f"w{w0}", win, SamplingParams(max_tokens=1), max_tokens=1)
        seq.block_table = list(range(-(-len(win) // cfg.block_size)))
        rounding.calls = 0
        logits, _ = runner.execute([Scheduled(seq, len(win))], list(range(len(win))))
        out.append(torch.log_softmax(logits.float()[: len(win) - 1], -1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--choices", default="f/f,r/r,f/r,r16/r16,r8/r8,b/r16,b/b")
    ap.add_argument("--text-tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m")
    wait_for_kernels()
    decode_stack._enabled = False  # the C decode step writes K/V itself: every step op by op
    rounding = Rounding()
    prompts, text = prompt_ids(loaded.tokenizer), stdlib_text(loaded.tokenizer, args.text_tokens)
    reference = greedy(loaded, {"quantization": "none"}, prompts, 32, one_by_one=False)
    base = log_probs(loaded, text, rounding)
    print(f"| K | V | KL vs unrounded ({len(base)} positions) | top-1 changed | greedy, one batch | prompt by prompt |")
    print("|---|---|---|---|---|---|")
    for choice in args.choices.split(","):
        t0 = time.perf_counter()
        rounding.k, rounding.v = choice.split("/")
        agree = [sum(a == b for a, b in zip(reference, greedy(loaded, {"kv_cache_dtype": "fp32"}, prompts, 32, one),
                                            strict=True)) for one in (False, True)]
        lp = log_probs(loaded, text, rounding)
        kl = (base.exp() * (base - lp)).sum(-1).mean().item()
        flips = (base.argmax(-1) != lp.argmax(-1)).float().mean().item()
        print(f"| {rounding.k} | {rounding.v} | {kl:.2e} | {flips:.2%} | {agree[0]}/{len(prompts)} | "
              f"{agree[1]}/{len(prompts)} ({time.perf_counter() - t0:.0f} s) |", flush=True)


if __name__ == "__main__":
    main()
