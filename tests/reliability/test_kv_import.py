"""KV import pins the cached blocks it builds on: allocating the missing blocks must not evict the head
of the very prefix chain being imported."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fleetllm.disagg.frame import FrameHeader
from fleetllm.disagg.kv_io import import_blocks
from fleetllm.engine.block_pool import BlockPool, hash_prefix_blocks

BS, LAYERS, HEADS, DIM = 2, 1, 1, 4


def _engine(num_blocks: int) -> SimpleNamespace:
    """What import_blocks reads of an engine: its pool, KV views, layout, context and the scheduler's headroom."""
    pool = BlockPool(num_blocks, BS)
    views = [(torch.zeros(num_blocks, BS, HEADS, DIM), torch.zeros(num_blocks, BS, HEADS, DIM))]
    cfg = SimpleNamespace(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    return SimpleNamespace(pool=pool, kv_blocks=lambda: views, loaded=SimpleNamespace(config=cfg), model_name="m",
                           max_model_len=num_blocks * BS,
                           kv=SimpleNamespace(extra_key=b"m", key_of=lambda lora_name: b"m"), scheduler=SimpleNamespace(watermark_blocks=0))


def test_importing_onto_a_cached_head_block_keeps_that_block() -> None:
    eng = _engine(3)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = hash_prefix_blocks(tokens, BS, b"m")
    # the chain's first block is cached here and free, first in line to be reused
    ids = eng.pool.allocate(3)
    eng.pool.register(ids[0], hashes[0], tokens[:BS])
    eng.pool.release(ids[:1])
    eng.pool.release(ids[1:])
    assert next(iter(eng.pool.free)) == ids[0]
    header = FrameHeader("m", LAYERS, HEADS, DIM, "float32", BS, tokens, hashes)
    layers = [(torch.ones(3, BS, HEADS, DIM), torch.ones(3, BS, HEADS, DIM))]

    result = import_blocks(eng, header, layers)

    assert result == {"imported": 2, "already_cached": 1, "dropped": 0, "tail": 0}
    assert all(h in eng.pool.cached for h in hashes), "the import evicted a block of its own prefix"
    eng.pool.check()
    assert eng.pool.num_free == 3  # nothing stays pinned
