"""Export a prompt's KV blocks from one engine; import them into another engine's prefix cache.

Both run on the engine's own thread (:meth:`AsyncEngine.call`), between steps. Import writes each
block into a fresh pool block, registers it under its hash (a ``stored`` KV event) and releases it:
the block sits in the prefix cache like a block this engine computed and freed, so the decode request
that follows takes it as a prefix hit and continues exactly as after a local prefill. Blocks already
cached are pinned (a reference taken) while the missing ones are allocated, so the allocation's LRU
eviction can never take the head of the chain being imported. Nothing is left
allocated — an imported block nobody claims is simply reused later (LRU), which is also how blocks of
an abandoned transfer are cleaned up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fleetllm.disagg.frame import FrameError, FrameHeader
from fleetllm.engine.block_pool import BlockPool, hash_block

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine


def export_blocks(engine: LLMEngine, token_ids: list[int]) -> tuple[FrameHeader, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The cached full blocks of ``token_ids`` (the leading run still in the prefix cache), copied out."""
    bs = engine.pool.block_size
    ids, hashes = engine.kv.cached_prefix(list(token_ids))
    cfg = engine.loaded.config
    views = engine.kv_blocks()
    index = torch.tensor(ids, dtype=torch.long, device=views[0][0].device)
    layers = [(k.index_select(0, index).cpu(), v.index_select(0, index).cpu()) for k, v in views]
    dtype = str(views[0][0].dtype).removeprefix("torch.")
    header = FrameHeader(engine.model_name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, bs,
                         list(token_ids[: len(ids) * bs]), hashes)
    return header, layers


def import_blocks(engine: LLMEngine, header: FrameHeader, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, int]:
    """Register the frame's blocks in ``engine``'s prefix cache; blocks already cached are skipped.

    Raises :class:`FrameError` if the frame does not fit this engine (model, layout, hashes)."""
    cfg = engine.loaded.config
    views = engine.kv_blocks()
    # the dtype may differ (a bf16 KV pool sending to an fp32 one, or back): blocks are cast as they are written
    expect = (engine.model_name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, engine.pool.block_size)
    got = (header.model, header.num_layers, header.num_kv_heads, header.head_dim, header.block_size)
    if got != expect:
        raise FrameError(f"frame for {got} does not fit this engine {expect}")
    pool = engine.pool
    missing, pinned = _walk(header, pool, engine.kv.extra_key)
    for bid in pinned:  # a reference on what is cached: allocating below must not evict the chain's head
        pool.touch(bid)
    try:
        # keep the scheduler's headroom: never take more than the free blocks beyond the watermark
        room = pool.num_free - engine.scheduler.watermark_blocks
        todo = missing[: max(0, room)]
        if todo:
            _write_blocks(pool, views, layers, todo)
    finally:
        pool.release(pinned)
    return {"imported": len(todo), "already_cached": header.num_blocks - len(missing), "dropped": len(missing) - len(todo)}


Missing = tuple[int, int, list[int], int | None]  # frame index, hash, tokens, the previous block's hash


def _walk(header: FrameHeader, pool: BlockPool, extra: bytes) -> tuple[list[Missing], list[int]]:
    """The frame's blocks not cached here as (frame index, hash, tokens, previous block's hash), and the pool
    ids of those that are; FrameError if a hash does not match its tokens."""
    bs = header.block_size
    parent = None
    missing, cached = [], []
    for i, h in enumerate(header.block_hashes):
        chunk = header.token_ids[i * bs : (i + 1) * bs]
        prev, parent = parent, hash_block(parent, chunk, extra)
        if parent != h:
            raise FrameError(f"block {i}: hash does not match its tokens")
        bid = pool.lookup(h, chunk)
        if bid is None:
            missing.append((i, h, chunk, prev))
        else:
            cached.append(bid)
    return missing, cached


def _write_blocks(pool: BlockPool, views: list[tuple[torch.Tensor, torch.Tensor]],
                  layers: list[tuple[torch.Tensor, torch.Tensor]], todo: list[Missing]) -> None:
    """Copy the ``todo`` blocks of the frame into fresh pool blocks, register them and release them."""
    new = pool.allocate(len(todo))
    src = torch.tensor([t[0] for t in todo], dtype=torch.long)
    dst = torch.tensor(new, dtype=torch.long, device=views[0][0].device)
    for (kc, vc), (k, v) in zip(views, layers, strict=True):
        kc.index_copy_(0, dst, k.index_select(0, src).to(kc.device, kc.dtype))
        vc.index_copy_(0, dst, v.index_select(0, src).to(vc.device, vc.dtype))
    for bid, (_, h, chunk, prev) in zip(new, todo, strict=True):
        pool.register(bid, h, chunk, prev)
    pool.release(new)
