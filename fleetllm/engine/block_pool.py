"""The KV block pool: fixed-size blocks, reference counts, prefix-cache hash map and LRU reuse.

Invariants (checked by :meth:`BlockPool.check`): a block is in the free list iff its ref count is 0;
a cached hash maps to a block whose ``hash`` is that hash; freeing a block with ref count 0 raises.
A freed block keeps its hash (still a prefix hit) until it is reused, least recently freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def hash_block(parent: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Chained, process-independent block hash: the router computes the same values."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def block_key(model: str, lora_name: str | None = None) -> bytes:
    """The bytes every block hash of a request mixes in (vLLM's ``extra_keys``): the served model's name, and the
    adapter's name for a request run with one, so that no prefix is shared across adapters or with the base."""
    return model.encode() if lora_name is None else model.encode() + b"\x00lora\x00" + lora_name.encode()


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> list[int]:
    """Hashes of every full block of ``token_ids``, each chained on the one before."""
    hashes: list[int] = []
    parent = 0
    data = np.asarray(token_ids, dtype=np.int64).tobytes()  # once, not per block: the same bytes as hash_block's
    step = block_size * 8
    for start in range(0, (len(token_ids) // block_size) * step, step):
        h = hashlib.blake2b(parent.to_bytes(8, "little", signed=False), digest_size=8)
        h.update(data[start : start + step])
        h.update(extra)
        parent = int.from_bytes(h.digest(), "little")
        hashes.append(parent)
    return hashes


class DoubleFree(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # re-checked on a hit so a hash collision is never a wrong hit
    parent: int | None = None  # the previous block's hash (None: the first block), for KV events in vLLM's format
    lora_name: str | None = None  # the adapter its KV was computed with (None: the base model), for KV events


class BlockPool:
    """Owns every KV block; hands them out and takes them back. ``on_event`` receives KV events."""

    def __init__(self, num_blocks: int, block_size: int, on_event: Callable[[str, list[int]], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.on_event = on_event
        # called with (block id, hash, token ids) of cached blocks as allocate reuses them, their KV still intact
        # (a KV tier keeps it): the new owner writes them only in a later step
        self.on_evict: list[Callable[[list[tuple[int, int, tuple[int, ...]]]], None]] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, evicting the least recently freed cached ones. Caller checks ``num_free``."""
        if n > len(self.free):
            raise MemoryError(f"asked for {n} blocks, {len(self.free)} free")
        out = []
        evicted = []
        gone: list[tuple[int, int, tuple[int, ...]]] = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            b = self.blocks[bid]
            if b.hash is not None:
                if self.cached.get(b.hash) == bid:
                    del self.cached[b.hash]
                    evicted.append(b.hash)
                    if b.token_ids is not None:
                        gone.append((bid, b.hash, b.token_ids))
                b.hash, b.token_ids, b.lora_name = None, None, None
            b.ref_count = 1
            out.append(bid)
        if evicted and self.on_event:
            self.on_event("removed", evicted)
        for listener in self.on_evict if gone else ():
            listener(gone)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the free list.

        Blocks are released in reverse so a sequence's tail blocks (the least shareable) are reused first.
        """
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            if b.ref_count <= 0:
                raise DoubleFree(f"block {bid} freed with ref_count {b.ref_count}")
            b.ref_count -= 1
            if b.ref_count == 0:
                self.free[bid] = None

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """A cached block holding exactly ``token_ids`` under ``block_hash``, or None."""
        bid = self.cached.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != tuple(token_ids):
            return None
        return bid

    def touch(self, bid: int) -> None:
        """Take a reference on a cached block (a prefix hit)."""
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self.free[bid]
        b.ref_count += 1

    def register(self, bid: int, block_hash: int, token_ids: Sequence[int], parent: int | None = None,
                 lora_name: str | None = None) -> None:
        """Mark a full, computed block as reusable by hash (first writer wins on duplicates); ``parent`` is the
        hash of the block before it in its sequence, ``lora_name`` the adapter its KV was computed with."""
        b = self.blocks[bid]
        if b.hash is not None or block_hash in self.cached:
            return
        b.hash, b.token_ids, b.parent, b.lora_name = block_hash, tuple(token_ids), parent, lora_name
        self.cached[block_hash] = bid
        if self.on_event:
            self.on_event("stored", [block_hash])

    def forget_adapter(self, lora_name: str) -> None:
        """Make the cached blocks computed with ``lora_name`` unhittable (the adapter was unloaded: a later one of
        the same name may differ)."""
        gone = [h for h, bid in self.cached.items() if self.blocks[bid].lora_name == lora_name]
        for h in gone:
            b = self.blocks[self.cached.pop(h)]
            b.hash, b.token_ids, b.lora_name = None, None, None
        if gone and self.on_event:
            self.on_event("removed", gone)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change)."""
        cleared = list(self.cached)
        for b in self.blocks:
            b.hash, b.token_ids = None, None
        self.cached.clear()
        if cleared and self.on_event:
            self.on_event("removed", cleared)

    def check(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; with ``expected_refs`` also that ref counts match the holders."""
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} ref {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in self.free), f"block {b.block_id} free-list mismatch"
            if expected_refs is not None:
                assert b.ref_count == expected_refs.get(b.block_id, 0), f"block {b.block_id} ref {b.ref_count}"
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h
