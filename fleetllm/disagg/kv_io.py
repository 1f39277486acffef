"""Export a prompt's KV blocks from one engine; import them into another engine's prefix cache.

Both run on the engine's own thread (:meth:`AsyncEngine.call`), between steps. Import writes each
block into a fresh pool block, registers it under its hash (a ``stored`` KV event) and releases it:
the block sits in the prefix cache like a block this engine computed and freed, so the decode request
that follows takes it as a prefix hit and continues exactly as after a local prefill. Nothing is left
allocated — an imported block nobody claims is simply reused later (LRU), which is also how blocks of
an abandoned transfer are cleaned up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fleetllm.disagg.frame import FrameError, FrameHeader
from fleetllm.engine.block_pool import hash_block

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
    dtype = str(views[0][0].dtype).removeprefix("torch.")
    expect = (engine.model_name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, engine.pool.block_size)
    got = (header.model, header.num_layers, header.num_kv_heads, header.head_dim, header.dtype, header.block_size)
    if got != expect:
        raise FrameError(f"frame for {got} does not fit this engine {expect}")
    bs, pool = header.block_size, engine.pool
    extra = engine.kv.extra_key
    parent = None
    missing = []  # (frame index, hash, tokens) of blocks not cached here yet
    for i, h in enumerate(header.block_hashes):
        chunk = header.token_ids[i * bs : (i + 1) * bs]
        parent = hash_block(parent, chunk, extra)
        if parent != h:
            raise FrameError(f"block {i}: hash does not match its tokens")
        if pool.lookup(h, chunk) is None:
            missing.append((i, h, chunk))
    # keep the scheduler's headroom: never take more than the free blocks beyond the watermark
    room = pool.num_free - engine.scheduler.watermark_blocks
    todo = missing[: max(0, room)]
    if todo:
        new = pool.allocate(len(todo))
        src = torch.tensor([i for i, _, _ in todo], dtype=torch.long)
        dst = torch.tensor(new, dtype=torch.long, device=views[0][0].device)
        for (kc, vc), (k, v) in zip(views, layers, strict=True):
            kc.index_copy_(0, dst, k.index_select(0, src).to(kc.device, kc.dtype))
            vc.index_copy_(0, dst, v.index_select(0, src).to(vc.device, vc.dtype))
        for bid, (_, h, chunk) in zip(new, todo, strict=True):
            pool.register(bid, h, chunk)
        pool.release(new)
    return {"imported": len(todo), "already_cached": header.num_blocks - len(missing), "dropped": len(missing) - len(todo)}
