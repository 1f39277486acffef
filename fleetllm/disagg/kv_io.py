"""Export a prompt's KV blocks from one engine; import them into another engine's prefix cache.

Import is three steps, so that the bulk copy never holds up the engine's steps:

1. :func:`reserve` (engine thread, between steps): check the frame fits, pin the blocks already cached,
   allocate fresh pool blocks for the missing ones. Pinning matters: the allocation's LRU eviction
   must never take the head of the chain being imported.
2. :func:`write` (any thread): copy the frame's blocks straight into those pool blocks, converting from
   the wire dtype. Nothing reads them meanwhile: they are allocated and not yet registered.
3. :func:`commit` (engine thread): register each full block under its hash (a ``stored`` KV event) and
   release it — it sits in the prefix cache like a block this engine computed and freed, so the decode
   request that follows takes it as a prefix hit and continues exactly as after a local prefill.
   :func:`commit_held` registers them too but keeps every block of the prompt held, in order, the partial
   last block included (never registered: it is not full), for the request to take over
   (:mod:`fleetllm.engine.handoff`). :func:`cancel` instead releases the blocks unregistered: a failed
   import leaves nothing behind.

After :func:`commit` nothing is left allocated: an imported block nobody claims is simply reused later
(LRU), which is also how blocks of an abandoned transfer are cleaned up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fleetllm.disagg.frame import DTYPES, FrameError, FrameHeader
from fleetllm.engine.block_pool import BlockPool, hash_block
from fleetllm.kernels import kv8

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.engine.kv_connector.access import BlockAccess

    Blocks = BlockAccess | LLMEngine  # a connector's access to its engine's blocks (an engine itself in tests)

Layers = list[tuple[torch.Tensor, torch.Tensor]]
Missing = tuple[int, int, list[int], int | None]  # frame index, hash, tokens, the previous block's hash


def pool_dtype(engine: Blocks) -> str:
    """The KV cache's dtype as a frame names it (``float32``, ``bfloat16``, ``float16``, ``int8``, ``float8_e4m3fn``,
    ``float8_e5m2``)."""
    return str(engine.kv_blocks()[0][0].dtype).removeprefix("torch.")


def frame_header(engine: Blocks, token_ids: list[int], hashes: list[int], dtype: str | None = None,
                 tail: bool = False, lora_name: str | None = None) -> FrameHeader:
    """The header of a frame of ``token_ids``' first ``len(hashes)`` blocks (with ``tail``: and the partial block
    of the tokens after them, all of ``token_ids``), in ``dtype`` (default: the pool's), computed with adapter
    ``lora_name`` (None: the base model; ``hashes`` are keyed by it)."""
    cfg, bs = engine.loaded.config, engine.pool.block_size
    ids = list(token_ids) if tail else list(token_ids[: len(hashes) * bs])
    return FrameHeader(engine.model_name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype or pool_dtype(engine),
                       bs, ids, list(hashes), lora_name)


def export_blocks(engine: Blocks, token_ids: list[int], dtype: str | None = None,
                  lora_name: str | None = None) -> tuple[FrameHeader, Layers]:
    """The cached full blocks of ``token_ids`` computed with adapter ``lora_name`` (None: the base model; the
    leading run still in the prefix cache), copied out in ``dtype`` (default: the pool's)."""
    ids, hashes = engine.kv.cached_prefix(list(token_ids), lora_name)
    header = frame_header(engine, token_ids, hashes, dtype, lora_name=lora_name)
    views = engine.kv_blocks()
    index = torch.tensor(ids, dtype=torch.long, device=views[0][0].device)
    wire = DTYPES[header.dtype]
    layers = [(kv8.convert(k.index_select(0, index), wire).cpu(), kv8.convert(v.index_select(0, index), wire).cpu())
              for k, v in views]
    return header, layers


@dataclass
class Reservation:
    """Pool blocks held for one import: fresh ones to fill (``todo``, ``new``; ``tail``: the partial last
    block's), cached ones pinned."""

    header: FrameHeader
    todo: list[Missing] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)
    missing: int = 0
    tail: int | None = None
    _runs: list[tuple[int, int, int]] | None = None

    def result(self) -> dict[str, int]:
        """Full blocks imported, found cached, dropped (no room); and whether the partial block was written."""
        h = self.header
        return {"imported": len(self.new), "already_cached": len(h.block_hashes) - self.missing,
                "dropped": self.missing - len(self.new), "tail": int(self.tail is not None)}

    def copies(self) -> list[tuple[int, int]]:
        """``(frame block, pool block)`` of every block to write, in frame order."""
        pairs = [(i, bid) for (i, *_), bid in zip(self.todo, self.new, strict=True)]
        return pairs + ([(len(self.header.block_hashes), self.tail)] if self.tail is not None else [])

    def table(self) -> list[int] | None:
        """The pool block of each of the frame's blocks, in order (None: one has none, dropped for room)."""
        if self.missing > len(self.new) or (self.header.tail and self.tail is None):
            return None
        written, pinned = dict(self.copies()), iter(self.pinned)
        return [written[i] if i in written else next(pinned) for i in range(self.header.num_blocks)]

    def runs(self) -> list[tuple[int, int, int]]:
        """The copy as runs ``(frame block, pool block, count)`` of consecutive blocks on both sides."""
        if self._runs is None:
            self._runs = _runs(self.copies())
        return self._runs


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(source, destination)`` block pairs as runs ``(source, destination, count)`` consecutive on both sides."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(a, b, n) for a, b, n in runs]


def check_fits(engine: Blocks, header: FrameHeader) -> None:
    """Any thread: raise :class:`FrameError` unless the frame's model and layout are this engine's and its prompt
    fits its context and pool (so the frame's size, which follows from the header, is bounded by the pool's)."""
    cfg = engine.loaded.config
    expect = (engine.model_name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, engine.pool.block_size)
    got = (header.model, header.num_layers, header.num_kv_heads, header.head_dim, header.block_size)
    if got != expect or header.dtype not in DTYPES:
        raise FrameError(f"frame for {str(got)[:200]} ({header.dtype}) does not fit this engine {expect}")
    if len(header.token_ids) > engine.max_model_len or header.num_blocks > engine.pool.num_blocks:
        raise FrameError(f"a frame of {len(header.token_ids)} tokens in {header.num_blocks} blocks: this engine "
                         f"holds at most {engine.max_model_len} tokens in {engine.pool.num_blocks} blocks")


def reserve(engine: Blocks, header: FrameHeader, whole: bool = False) -> Reservation:
    """Engine thread: pin the frame's blocks cached here, allocate pool blocks for the missing ones (as many as
    fit above the scheduler's watermark). Raises :class:`FrameError` if the frame does not fit this engine.

    ``whole``: a fresh block for every one of the frame's blocks, those cached here too (a prefill computing in
    place writes each block it computes, and must never write one other requests read); registering those at
    the commit is a no-op (the cached one stays), and they go back unregistered when their request ends."""
    check_fits(engine, header)
    pool = engine.pool
    missing, pinned = _walk(header, pool, engine.kv.key_of(header.lora_name), whole)
    for bid in pinned:  # a reference on what is cached: allocating below must not evict the chain's head
        pool.touch(bid)
    room = pool.num_free - engine.scheduler.watermark_blocks  # keep the scheduler's headroom
    todo = missing[: max(0, room)]
    res = Reservation(header, todo, pool.allocate(len(todo)) if todo else [], pinned, len(missing))
    if header.tail and room > len(todo):  # the partial block: only for the request to take over, never cached
        res.tail = pool.allocate(1)[0]
    return res


def write(views: Layers, layers: Layers, res: Reservation, rows: list[int] | None = None) -> None:
    """Any thread: copy the reserved blocks of the frame (views over its bytes; with ``rows``, frame block ``i``
    is row ``rows[i]`` of ``layers``, as when they are another pool's blocks) into the pool blocks."""
    copies = res.copies()
    if not copies:
        return
    if rows is not None:
        copies = [(rows[a], b) for a, b in copies]
    runs = res.runs() if rows is None else _runs(copies)
    scattered = len(runs) > _MAX_RUNS  # then one indexed copy per tensor, else a slice copy per run
    if scattered:
        device = views[0][0].device
        src = torch.tensor([a for a, _ in copies], dtype=torch.long)
        dst = torch.tensor([b for _, b in copies], dtype=torch.long, device=device)
    for (kc, vc), (k, v) in zip(views, layers, strict=True):
        for cache, part in ((kc, k), (vc, v)):
            if scattered:
                kv8.copy_rows(cache, dst, part.index_select(0, src).to(device))
            else:
                for a, b, n in runs:  # converted when the layouts differ (copy_ converts the rest)
                    cache[b : b + n].copy_(kv8.convert(part[a : a + n], cache.dtype))

_MAX_RUNS = 8


def commit(engine: Blocks, res: Reservation) -> dict[str, int]:
    """Engine thread: register the written blocks in the prefix cache and release every block held."""
    pool = engine.pool
    for bid, (_, h, chunk, prev) in zip(res.new, res.todo, strict=True):
        pool.register(bid, h, chunk, prev, res.header.lora_name)
    result = res.result()
    cancel(engine, res)  # released after registration: in the prefix cache, owned by nobody
    return result


def commit_held(engine: Blocks, res: Reservation) -> tuple[dict[str, int], list[int] | None]:
    """Engine thread: register the written full blocks as :func:`commit` does, but keep every block of the
    frame held for its request to take over; return the result and the blocks in order (ownership passes to
    the caller). None when a block is missing (no room for it): then everything is released as by commit."""
    table = res.table()
    if table is None:
        return commit(engine, res), None
    pool = engine.pool
    for bid, (_, h, chunk, prev) in zip(res.new, res.todo, strict=True):
        pool.register(bid, h, chunk, prev, res.header.lora_name)
    result = res.result()
    res.new, res.pinned, res.tail = [], [], None  # held by the table now
    return result, table


def cancel(engine: Blocks, res: Reservation) -> None:
    """Engine thread: release every block held (fresh ones unregistered: the import never happened)."""
    engine.pool.release(res.new + ([res.tail] if res.tail is not None else []))
    engine.pool.release(res.pinned)
    res.new, res.pinned, res.tail = [], [], None


def hold(engine: Blocks, blocks: list[int]) -> None:
    """Engine thread: one more reference on each of ``blocks`` (they stay out of eviction until released)."""
    for bid in blocks:
        engine.pool.touch(bid)


def release(engine: Blocks, blocks: list[int]) -> None:
    """Engine thread: drop a reference on each of ``blocks`` (held ones, or a handoff's)."""
    engine.pool.release(blocks)


def import_blocks(engine: Blocks, header: FrameHeader, layers: Layers) -> dict[str, int]:
    """Reserve, write and commit in one go (on the engine thread); blocks already cached are skipped.

    Raises :class:`FrameError` if the frame does not fit this engine (model, layout, hashes)."""
    res = reserve(engine, header)
    try:
        write(engine.kv_blocks(), layers, res)
    except BaseException:
        cancel(engine, res)
        raise
    return commit(engine, res)


def _walk(header: FrameHeader, pool: BlockPool, extra: bytes, whole: bool = False) -> tuple[list[Missing], list[int]]:
    """The frame's blocks not cached here (``whole``: all of them) as (frame index, hash, tokens, previous block's
    hash), and the pool ids of those that are (``whole``: none); FrameError if a hash does not match its tokens."""
    bs = header.block_size
    parent = None
    missing, cached = [], []
    for i, h in enumerate(header.block_hashes):
        chunk = header.token_ids[i * bs : (i + 1) * bs]
        prev, parent = parent, hash_block(parent, chunk, extra)
        if parent != h:
            raise FrameError(f"block {i}: hash does not match its tokens")
        bid = None if whole else pool.lookup(h, chunk)
        if bid is None:
            missing.append((i, h, chunk, prev))
        else:
            cached.append(bid)
    return missing, cached
