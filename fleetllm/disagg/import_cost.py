"""What importing a KV frame costs the decode worker, measured in-process on a real engine.

The decode side of a P/D transfer verifies each layer (CRC over its bytes) and copies its blocks into pool
blocks reserved for it (:mod:`.kv_io`), on a thread beside the engine's steps. Two things follow for a fleet:

- the imported request's first decode waits for the import: ``frame bytes / rate``;
- on a CPU worker the import thread runs on the cores the decode steps use, so the steps that overlap it
  take longer: ``steal`` is the share of the import's time that they lose (1.0: all of it).

The pool is mapped lazily (:mod:`fleetllm.engine.kv_memory`) and its free list hands out blocks
in order, so a serving worker imports into pages never touched before until its pool has been cycled
once: the first touch (a page fault, the kernel zeroing the page) costs more than the copy. :func:`measure`
reports both: into fresh pages (what a fleet run sees) and into pages already written.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fleetllm.disagg.frame import FrameReader, encode
from fleetllm.disagg.kv_io import Reservation, commit, frame_header, reserve, write
from fleetllm.engine.block_pool import hash_prefix_blocks

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine


@dataclass(frozen=True)
class ImportTiming:
    """One import of a frame of ``nbytes``: seconds verifying (CRC) and copying into the pool."""

    nbytes: int
    verify_s: float
    copy_s: float

    @property
    def seconds(self) -> float:
        return self.verify_s + self.copy_s

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds


@dataclass(frozen=True)
class ImportCost:
    """Measured import rates (bytes/s) into fresh (and, if measured, warm) pool pages, and the decode steps' share."""

    cold_bytes_per_s: float
    steal: float  # of the import's seconds, the share overlapping decode steps lose (one core each)
    warm_bytes_per_s: float | None = None


class FrameMaker:
    """Frames of ``tokens`` prompt tokens in ``engine``'s layout, each of different tokens (nothing cached)."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine, self.count = engine, seed
        self.vocab = min(engine.loaded.config.vocab_size, 30000)

    def frame(self, tokens: int) -> bytearray:
        """A whole frame (header, every layer's K and V, trailer) of random KV values."""
        self.count += 1
        ids = [(self.count * 7919 + i * 31) % (self.vocab - 100) + 100 for i in range(tokens)]
        eng = self.engine
        header = frame_header(eng, ids, hash_prefix_blocks(ids, eng.pool.block_size, eng.kv.extra_key))
        values = (*header.shape[:3], header.head_dim)  # the rows' values (an 8-bit wire row adds its scales)
        layers = [(torch.randn(values), torch.randn(values)) for _ in range(header.num_layers)]
        return bytearray(b"".join(encode(header, layers)))


def import_frame(engine: LLMEngine, buf: bytearray) -> ImportTiming:
    """Import ``buf`` as the decode worker does (reserve, per layer verify then copy, commit), timed."""
    reader = FrameReader(buf)
    res = reserve(engine, reader.header)
    timing = verify_and_copy(engine, reader, res)
    commit(engine, res)
    return timing


def verify_and_copy(engine: LLMEngine, reader: FrameReader, res: Reservation) -> ImportTiming:
    """The part of an import off the engine thread: each layer's CRC, then its copy into the reserved blocks."""
    views = engine.kv_blocks()
    verify = copy = 0.0
    for i in range(reader.header.num_layers):
        t0 = time.perf_counter()
        layer = reader.layer(i)
        t1 = time.perf_counter()
        write([views[i]], [layer], res)
        verify, copy = verify + t1 - t0, copy + time.perf_counter() - t1
    reader.finish()
    return ImportTiming(reader.size, verify, copy)


def touch_pool(engine: LLMEngine) -> None:
    """Write every pool page once, so that later imports copy into warm pages."""
    for k, v in engine.kv_blocks():
        k.zero_()
        v.zero_()


def decode_steal(engine: LLMEngine, maker: FrameMaker, tokens: int, rate: float, batch: int = 4,
                 steps: int = 6) -> tuple[float, float]:
    """Share of an import's seconds that decode steps running beside it lose, both on one core; and how long
    the import then took (what the imported request waits).

    Decode steps of ``batch`` sequences are timed alone, then while a thread verifies and copies a frame of
    ``tokens`` (into fresh pages, ``rate`` bytes/s alone); the steps overlapping it take ``steal × bytes / rate``
    more in all. Pins this process to one core meanwhile (the fleet's layout on CPU: one worker per core)."""
    from fleetllm.engine.params import SamplingParams

    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        params = SamplingParams(max_tokens=engine.max_model_len - 64, ignore_eos=True)  # runs until stopped here
        for n in range(batch):
            engine.add_request(f"steal-{n}", list(range(100 + n, 164 + n)), params)
        while any(not s.output_token_ids for s in engine.seqs.values()):
            engine.step()
        alone = statistics.median(_timed(engine.step) for _ in range(steps))
        reader = FrameReader(maker.frame(tokens))
        res = reserve(engine, reader.header)
        timing: list[ImportTiming] = []
        worker = threading.Thread(target=lambda: timing.append(verify_and_copy(engine, reader, res)))
        t0 = time.perf_counter()
        worker.start()
        busy = 0
        while worker.is_alive():
            engine.step()
            busy += 1
        worker.join()
        extra = time.perf_counter() - t0 - busy * alone
        commit(engine, res)
    finally:
        os.sched_setaffinity(0, cpus)
        for rid in list(engine.seqs):
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
    if not busy:  # the import ended before a step began beside it: nothing to tell
        return 0.0, timing[0].seconds
    return max(0.0, extra * rate / reader.size), timing[0].seconds


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(engine: LLMEngine, tokens: int = 512, repeats: int = 3, warm: bool = False,
            steal_tokens: int = 2048) -> ImportCost:
    """Import rate of frames of ``tokens`` into fresh pages of ``engine``'s pool, and the steal (median of
    ``repeats``, beside frames of ``steal_tokens``: an import spanning a few decode steps, so that one step's
    spread does not decide it); with ``warm``, then the whole pool written and the rate into warm pages too.

    The engine must be new (its pool's fresh pages not yet handed out) for the first rate to be the fresh one."""
    maker = FrameMaker(engine)
    cold = statistics.median(import_frame(engine, maker.frame(tokens)).bytes_per_s for _ in range(repeats))
    steal = statistics.median(decode_steal(engine, maker, steal_tokens, cold)[0] for _ in range(repeats))
    if not warm:
        return ImportCost(cold, round(steal, 3))
    touch_pool(engine)
    hot = statistics.median(import_frame(engine, maker.frame(tokens)).bytes_per_s for _ in range(repeats))
    return ImportCost(cold, round(steal, 3), hot)
