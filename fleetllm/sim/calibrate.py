"""``fleetllm calibrate``: measure the real engine's step times and write a :class:`TimingProfile`.

Prefix caching is off while measuring (every token is really computed). Prefill: one prompt of P
tokens in one step. Decode: B sequences with ``decode_context``-token prompts, timing decode-only
steps. Context cost: the same B at a long context. P/D import: a decode worker's verify and copy of a KV
frame into fresh pool pages, and the share of it that decode steps beside it lose
(:mod:`fleetllm.disagg.import_cost`), measured first, while the pool is fresh.

Robustness: the machine is shared, and a burst of other work lasts seconds, long enough to spoil every
step of one point if its steps are timed back to back. So every point is measured once per *sweep* (each
sweep a median of a few steps), the sweeps run one after another over all points, and the profile keeps
each point's median over the sweeps. The decode curve is kept as measured, not forced monotone: on one
CPU thread the engine's fp32 matmuls really are slower at 2-3 rows than at 4 (reproducible across
sweeps), which is why the small batches are all measured.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence

from rich.progress import Progress

from fleetllm.sim.profile import TimingProfile

PREFILL_POINTS = (16, 64, 128, 256, 512)
DECODE_POINTS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
CONTEXT_BATCH = 8  # sequences of the two context points (short and long)
STEPS_PER_POINT = 3  # timed steps per point and sweep (their median)

Point = tuple[str, int]  # ("prefill", P), ("decode", B) or ("context", tokens of context)
Sweep = dict[Point, float]


class _Bench:
    """Timed steps of one real engine over synthetic prompts (each prompt different: no cache hits)."""

    def __init__(self, eng, steps: int) -> None:  # type: ignore[no-untyped-def]
        self.eng = eng
        self.steps = steps
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
        for _ in range(self.steps):
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
        t = statistics.median(self.timed_step() for _ in range(self.steps))
        self.drain()
        return t


def sweep(bench: _Bench, decode_context: int, long_context: int, advance: Callable[[], None] = lambda: None) -> Sweep:
    """Every point once: the prefill points, the decode points, then the two context points."""
    out: Sweep = {}
    for p in PREFILL_POINTS:
        out["prefill", p] = bench.prefill_time(p)
        advance()
    for b in DECODE_POINTS:
        out["decode", b] = bench.decode_time(b, decode_context)
        advance()
    for ctx in (decode_context, long_context):
        out["context", ctx] = bench.decode_time(CONTEXT_BATCH, ctx)
        advance()
    return out


def median_per_point(sweeps: Sequence[Sweep]) -> Sweep:
    """Each point's median over the sweeps (a point missing from a sweep counts from the others)."""
    points = dict.fromkeys(p for s in sweeps for p in s)
    return {p: statistics.median(s[p] for s in sweeps if p in s) for p in points}


def spread(sweeps: Sequence[Sweep]) -> dict[Point, float]:
    """Each point's (max - min) / median over the sweeps: how much the machine moved while calibrating."""
    mid = median_per_point(sweeps)
    return {p: (max(s[p] for s in sweeps if p in s) - min(s[p] for s in sweeps if p in s)) / m
            for p, m in mid.items() if m}


def profile_from(points: Sweep, decode_context: int, long_context: int, **fields) -> TimingProfile:  # type: ignore[no-untyped-def]
    """The profile of a (median) sweep; ``fields``: the engine's and machine's, and the KV import's."""
    short, long = points["context", decode_context], points["context", long_context]
    ctx_slope = max(0.0, (long - short) / (CONTEXT_BATCH * (long_context - decode_context)))
    return TimingProfile(prefill=sorted((n, t) for (kind, n), t in points.items() if kind == "prefill"),
                         decode=sorted((n, t) for (kind, n), t in points.items() if kind == "decode"),
                         ctx_s_per_token=ctx_slope, decode_context=decode_context, **fields)


def calibrate(model: str = "smollm2-135m", threads: int = 1, repeats: int = 3, decode_context: int = 64,
              long_context: int = 1024, kv_cache_gb: float = 1.0) -> TimingProfile:
    """Measure ``repeats`` sweeps over every point on a new engine; each point's median over them."""
    import torch

    from fleetllm.disagg.import_cost import measure
    from fleetllm.engine.engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    eng = LLMEngine(EngineConfig(model=model, num_threads=threads, enable_prefix_caching=False,
                                 max_num_batched_tokens=max(PREFILL_POINTS), max_num_seqs=max(DECODE_POINTS),
                                 kv_cache_gb=kv_cache_gb))
    bench = _Bench(eng, STEPS_PER_POINT)
    sweeps: list[Sweep] = []
    with Progress() as bar:
        task = bar.add_task("calibrating", total=1 + repeats * (len(PREFILL_POINTS) + len(DECODE_POINTS) + 2))
        bench.add(64, 4)  # warm-up
        while eng.has_unfinished():
            eng.step()
        kv_import = measure(eng, repeats=max(3, repeats))
        bar.advance(task)
        for _ in range(repeats):
            sweeps.append(sweep(bench, decode_context, long_context, lambda: bar.advance(task)))
        worst = max(spread(sweeps).items(), key=lambda kv: kv[1])
        bar.console.print(f"{repeats} sweeps; widest spread {worst[1]:.0%} at {worst[0][0]} {worst[0][1]}")
    return profile_from(median_per_point(sweeps), decode_context, long_context, model=model, device=eng.device,
                        threads=threads, block_size=eng.pool.block_size, num_blocks=eng.pool.num_blocks,
                        machine=f"{platform.machine()} {platform.processor()}".strip(), sweeps=repeats,
                        kv_import_bytes_per_s=round(kv_import.cold_bytes_per_s), kv_import_steal=kv_import.steal)
