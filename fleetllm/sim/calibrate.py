"""``fleetllm calibrate``: measure the real engine's step times and write a :class:`TimingProfile`.

Prefix caching is off while measuring (every token is really computed). Prefill: one prompt of P
tokens in one step. Decode: B sequences with ``decode_context``-token prompts, timing decode-only
steps. Context cost: the same B at a long context. Each point is the median of several steps. P/D import:
a decode worker's verify and copy of a KV frame into fresh pool pages, and the share of it that decode
steps beside it lose (:mod:`fleetllm.disagg.import_cost`), measured first, while the pool is fresh.
"""

from __future__ import annotations

import platform
import statistics
import time

from rich.progress import Progress

from fleetllm.sim.profile import TimingProfile

PREFILL_POINTS = (16, 64, 128, 256, 512)
DECODE_POINTS = (1, 2, 4, 8, 16, 32, 64)


class _Bench:
    """Timed steps of one real engine over synthetic prompts (each prompt different: no cache hits)."""

    def __init__(self, eng, repeats: int) -> None:  # type: ignore[no-untyped-def]
        self.eng = eng
        self.repeats = repeats
        self.vocab = min(eng.loaded.config.vocab_size, 30000)
        self.count = 0

    def prompt(self, n: int) -> list[int]:
        self.count += 1
        return [(self.count * 7919 + i * 31) % (self.vocab - 100) + 100 for i in range(n)]

    def add(self, n: int, max_tokens: int) -> None:
        from fleetllm.engine.params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.eng.add_request(f"r{self.count}", self.prompt(n), params)

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.eng.step()
        return time.perf_counter() - t0

    def drain(self) -> None:
        for rid in list(self.eng.seqs):
            self.eng.abort_request(rid)
        while self.eng.has_unfinished():
            self.eng.step()

    def prefill_time(self, p: int) -> float:
        """One prompt of ``p`` tokens in one step."""
        times = []
        for _ in range(self.repeats):
            self.add(p, 1)
            times.append(self.timed_step())
            self.drain()
        return statistics.median(times)

    def decode_time(self, b: int, ctx: int) -> float:
        """A decode-only step of ``b`` sequences at ``ctx`` tokens of context."""
        for _ in range(b):
            self.add(ctx, 64)
        while any(not s.output_token_ids for s in self.eng.seqs.values()):
            self.eng.step()
        t = statistics.median(self.timed_step() for _ in range(self.repeats + 2))
        self.drain()
        return t


def calibrate(model: str = "smollm2-135m", threads: int = 1, repeats: int = 3, decode_context: int = 64,
              long_context: int = 1024, kv_cache_gb: float = 1.0) -> TimingProfile:
    import torch

    from fleetllm.disagg.import_cost import measure
    from fleetllm.engine.engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    eng = LLMEngine(EngineConfig(model=model, num_threads=threads, enable_prefix_caching=False,
                                 max_num_batched_tokens=max(PREFILL_POINTS), max_num_seqs=max(DECODE_POINTS),
                                 kv_cache_gb=kv_cache_gb))
    bench = _Bench(eng, repeats)
    prefill: list[tuple[int, float]] = []
    decode: list[tuple[int, float]] = []
    with Progress() as bar:
        task = bar.add_task("calibrating", total=len(PREFILL_POINTS) + len(DECODE_POINTS) + 3)
        bench.add(64, 4)  # warm-up
        while eng.has_unfinished():
            eng.step()
        kv_import = measure(eng, repeats=repeats)
        bar.advance(task)
        for p in PREFILL_POINTS:
            prefill.append((p, bench.prefill_time(p)))
            bar.advance(task)
        for b in DECODE_POINTS:
            decode.append((b, bench.decode_time(b, decode_context)))
            bar.advance(task)
        short = bench.decode_time(8, decode_context)
        bar.advance(task)
        long = bench.decode_time(8, long_context)
        bar.advance(task)
    ctx_slope = max(0.0, (long - short) / (8 * (long_context - decode_context)))
    return TimingProfile(model=model, device=eng.device, threads=threads, block_size=eng.pool.block_size,
                         num_blocks=eng.pool.num_blocks, prefill=prefill, decode=decode, ctx_s_per_token=ctx_slope,
                         decode_context=decode_context, machine=f"{platform.machine()} {platform.processor()}".strip(),
                         kv_import_bytes_per_s=round(kv_import.cold_bytes_per_s), kv_import_steal=kv_import.steal)
