"""``fleetllm calibrate``: measure the real engine's step times and write a :class:`TimingProfile`.

Prefix caching is off while measuring (every token is really computed). Prefill: one prompt of P
tokens in one step. Decode: B sequences with ``decode_context``-token prompts, timing decode-only
steps. Context cost: the same B at a long context. Each point is the median of several steps.
"""

from __future__ import annotations

import platform
import statistics
import time

from rich.progress import Progress

from fleetllm.sim.profile import TimingProfile

PREFILL_POINTS = (16, 64, 128, 256, 512)
DECODE_POINTS = (1, 2, 4, 8, 16, 32, 64)


def calibrate(model: str = "smollm2-135m", threads: int = 1, repeats: int = 3, decode_context: int = 64,
              long_context: int = 1024, kv_cache_gb: float = 1.0) -> TimingProfile:
    import torch

    from fleetllm.engine.engine import EngineConfig, LLMEngine
    from fleetllm.engine.params import SamplingParams

    torch.set_num_threads(threads)
    eng = LLMEngine(EngineConfig(model=model, num_threads=threads, enable_prefix_caching=False,
                                 max_num_batched_tokens=max(PREFILL_POINTS), max_num_seqs=max(DECODE_POINTS),
                                 kv_cache_gb=kv_cache_gb))
    vocab = min(eng.loaded.config.vocab_size, 30000)
    counter = [0]

    def prompt(n: int) -> list[int]:
        counter[0] += 1
        return [(counter[0] * 7919 + i * 31) % (vocab - 100) + 100 for i in range(n)]

    def timed_step() -> float:
        t0 = time.perf_counter()
        eng.step()
        return time.perf_counter() - t0

    def drain() -> None:
        for rid in list(eng.seqs):
            eng.abort_request(rid)
        while eng.has_unfinished():
            eng.step()

    def decode_time(b: int, ctx: int) -> float:
        for _ in range(b):
            eng.add_request(f"d{counter[0]}", prompt(ctx), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        while any(not s.output_token_ids for s in eng.seqs.values()):
            eng.step()
        t = statistics.median(timed_step() for _ in range(repeats + 2))
        drain()
        return t

    prefill: list[tuple[int, float]] = []
    decode: list[tuple[int, float]] = []
    with Progress() as bar:
        task = bar.add_task("calibrating", total=len(PREFILL_POINTS) + len(DECODE_POINTS) + 2)
        eng.add_request("warm", prompt(64), SamplingParams(max_tokens=4, temperature=0))
        while eng.has_unfinished():
            eng.step()
        for p in PREFILL_POINTS:
            times = []
            for _ in range(repeats):
                eng.add_request(f"p{counter[0]}", prompt(p), SamplingParams(max_tokens=1, temperature=0))
                times.append(timed_step())
                drain()
            prefill.append((p, statistics.median(times)))
            bar.advance(task)
        for b in DECODE_POINTS:
            decode.append((b, decode_time(b, decode_context)))
            bar.advance(task)
        short = decode_time(8, decode_context)
        bar.advance(task)
        long = decode_time(8, long_context)
        bar.advance(task)
    ctx_slope = max(0.0, (long - short) / (8 * (long_context - decode_context)))
    return TimingProfile(model=model, device=eng.device, threads=threads, block_size=eng.pool.block_size,
                         num_blocks=eng.pool.num_blocks, prefill=prefill, decode=decode, ctx_s_per_token=ctx_slope,
                         decode_context=decode_context, machine=f"{platform.machine()} {platform.processor()}".strip())
