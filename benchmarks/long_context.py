"""Per-user decode speed against context length: Gemma 3 270M (five of six layers sliding-window) and SmolLM2.

One session at a time on an in-process engine with the worker's default flags (``q4`` weights, the model's
fp32 KV cache, prefix caching), its KV pool and ``max_model_len`` sized for the longest context. Every
context's prompt is a prefix of one long prompt, computed once up front, so each measurement costs a
prefix-cache hit, the prompt's last partial block and ``--steps`` decode steps. Rounds interleave the contexts
and thread counts, so that load drifting on a shared machine falls on every cell alike; each cell keeps its
median over rounds. Per-user tok/s is the issue's: output tokens after the first / (last token's time - first
token's time). The goal (issue 41): Gemma 3's figure at 24k within 25% of its figure at 2k. Then the part of a
step that grows with the context: the paged decode kernel over one row of the model's attention shape.

    python benchmarks/long_context.py                                  # both models, 1 and 2 threads
    python benchmarks/long_context.py --models gemma3-270m --contexts 2048,24576 --threads 1 --rounds 1
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import save_run  # noqa: E402

CONTEXTS = {"gemma3-270m": "2048,8192,16384,24576,32000", "smollm2-135m": "1024,4096,8000"}
_ids = itertools.count()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma3-270m,smollm2-135m", help="comma-separated (default: %(default)s)")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths (default: per model, "
                                                    f"{CONTEXTS})")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per cell, median kept (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (default: %(default)s)")
    p.add_argument("--speculative", default=None, help="the engine's --speculative (default: the engine's, suffix "
                                                       "drafting, which drafts from this benchmark's repetitive "
                                                       "prompt; none isolates the attention's cost)")
    p.add_argument("--no-save", action="store_true", help="print only, write nothing to results/")
    return p.parse_args(argv)


def engine_for(model: str, longest: int, steps: int, kv_dtype: str,  # noqa: ANN201 - LLMEngine, imported late
               speculative: str | None = None):
    """An engine with the worker's defaults (``speculative``: that flag instead) but a pool and ``max_model_len``
    that hold ``longest`` + ``steps``."""
    from fleetllm.engine.engine import EngineConfig, LLMEngine

    max_len = longest + steps + 64
    blocks = -(-max_len // 16) * 102 // 100 + 256  # the admission watermark (1%) and the measurements' own blocks
    spec = {} if speculative is None else {"speculative": speculative}
    return LLMEngine(EngineConfig(model=model, max_model_len=max_len, num_blocks=blocks, kv_cache_dtype=kv_dtype, **spec))


def decode_speed(engine, prompt: list[int], steps: int) -> float:  # noqa: ANN001
    """Per-user tok/s of one request over ``prompt``, ``steps`` tokens long (the issue's definition)."""
    from fleetllm.engine.sampling import SamplingParams

    rid = f"long-{next(_ids)}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    stamps: list[tuple[float, int]] = []
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        stamps += [(now, len(o.new_token_ids)) for o in outs if o.request_id == rid and o.new_token_ids]
    tokens = sum(n for _, n in stamps[1:])
    return tokens / (stamps[-1][0] - stamps[0][0])


def measure(model: str, contexts: list[int], threads: list[int],
            args: argparse.Namespace) -> tuple[dict[tuple[int, int], float], int, object]:
    """Median per-user tok/s per (context, threads) for ``model``, its KV cache's bytes per token, its config."""
    import torch

    from fleetllm.engine.model_runner import ModelRunner

    engine = engine_for(model, max(contexts), args.steps, args.kv_cache_dtype, args.speculative)
    runner = engine.executor.runner
    kv_per_token = ModelRunner.kv_bytes_per_block(runner.model, 1, runner.kv_dtype)
    contexts = [min(n, engine.max_model_len - args.steps - 1) for n in contexts]
    vocab = engine.loaded.config.vocab_size
    prompt = [(7 * j * j + 13 * j) % (min(vocab, 32000) - 1000) + 1000 for j in range(max(contexts))]
    torch.set_num_threads(max(threads))
    t0 = time.perf_counter()
    decode_speed(engine, prompt, 2)  # the longest prompt computed once: every measurement is a prefix hit
    print(f"{model}: {max(contexts)}-token prompt computed in {time.perf_counter() - t0:.0f} s", flush=True)
    got: dict[tuple[int, int], list[float]] = {}
    for r in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            for n in contexts:
                got.setdefault((n, t), []).append(decode_speed(engine, prompt[:n], args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{n}/{t}t {v[-1]:.1f}" for (n, t), v in got.items()), flush=True)
    return {k: statistics.median(v) for k, v in got.items()}, kv_per_token, engine.loaded.config


def attention_costs(cfg, contexts: list[int], threads: list[int]) -> str:  # noqa: ANN001 - a ModelConfig
    """Ms per call of the paged decode kernel for one row of ``cfg``'s attention shape at each context (a global
    layer), and at its sliding window (a local layer): the part of a step that grows with the context."""
    import torch

    from fleetllm.kernels.attention import kernel_ready, paged_attention

    bs, widest = 16, max(contexts)
    k = torch.randn(widest + bs, cfg.num_kv_heads, cfg.head_dim)
    v, q = torch.randn_like(k), torch.randn(1, cfg.num_heads, cfg.head_dim)
    table = torch.randperm(widest // bs + 1, dtype=torch.int32).view(1, -1)  # blocks in any order, as a pool has them
    if not kernel_ready(q, k, wait=True):
        return "(no paged attention kernel on this machine)\n"
    cases = [(n, None) for n in contexts] + ([(widest, cfg.sliding_window)] if cfg.sliding_window else [])
    lines = ["| keys read | " + " | ".join(f"ms, {t} thread{'s' * (t > 1)}" for t in threads) + " |",
             "|---:|" + "---:|" * len(threads)]
    for n, window in cases:
        cells = []
        for t in threads:
            torch.set_num_threads(t)
            lens = torch.tensor([n], dtype=torch.int32)
            call = lambda lens=lens, w=window: paged_attention(q, k, v, table, lens, 0.1, bs, w)  # noqa: E731
            cells.append(f"{statistics.median(_timed(call) for _ in range(30)) * 1e3:.2f}")  # robust to a stalled call
        lines.append(f"| {n if window is None else f'{window} (window)'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def table(model: str, res: dict[tuple[int, int], float], threads: list[int], kv_per_token: int) -> str:
    contexts = sorted({n for n, _ in res})
    head = "| context | " + " | ".join(f"tok/s, {t} thread{'s' * (t > 1)}" for t in threads) + " |"
    lines = [f"**{model}** (KV cache {kv_per_token / 1024:.0f} KiB per token)", "", head, "|---:|" + "---:|" * len(threads)]
    lines += [f"| {n:,} | " + " | ".join(f"{res[(n, t)]:.1f}" for t in threads) + " |" for n in contexts]
    lines.append("")
    for t in threads:  # each context against the shortest
        ratios = ", ".join(f"{n:,}: {res[(n, t)] / res[(contexts[0], t)]:.2f}" for n in contexts[1:])
        lines.append(f"{t} thread{'s' * (t > 1)}, against {contexts[0]:,}: {ratios}  ")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    out = []
    for model in args.models.split(","):
        contexts = [int(n) for n in (args.contexts or CONTEXTS.get(model, "1024,4096")).split(",")]
        res, kv_per_token, cfg = measure(model, contexts, threads, args)
        out.append(table(model, res, threads, kv_per_token))
        print(out[-1], flush=True)
        out.append(f"Decode attention of one row of {model}'s shape ({cfg.num_heads} heads, {cfg.num_kv_heads} KV "
                   f"heads, head dim {cfg.head_dim}, fp32):\n\n" + attention_costs(cfg, contexts, threads))
        print(out[-1], flush=True)
    load = f"load average {os.getloadavg()[0]:.2f} at the end"
    print(load)
    if not args.no_save:
        save_run("## Long context: per-user decode speed against context length", __doc__.split("\n\n")[0],
                 "python benchmarks/long_context.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "\n".join(out) + f"\n{load}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
