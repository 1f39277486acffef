"""Host memory as a KV tier: blocks kept by hash in a byte-capped LRU.

A block is stored as its K and V for every layer, ``[layers, block_size, kv_heads, head_dim]`` each, in the
pool's dtype (a copy, so loading it back is exact), with its token ids: a lookup re-checks them, so a hash
collision is never a wrong hit (as the pool's own prefix cache does). Torch is used only through the tensors
handed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# told ("stored" | "removed", block hashes, the stored blocks' token ids: empty for removals) as blocks enter
# and leave a tier: the worker's KV events (its native stream and vLLM's format)
TierListener = Callable[[str, list[int], list[int]], None]


@dataclass(frozen=True)
class HostBlock:
    """One block's KV in host memory."""

    token_ids: tuple[int, ...]
    k: torch.Tensor  # [layers, block_size, kv_heads, head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class HostStore:
    """Blocks by hash, least recently used dropped first once ``capacity_bytes`` would be passed."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[int, HostBlock] = OrderedDict()
        self.listeners: list[TierListener] = []  # KV events

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def hashes(self) -> list[int]:
        """The hashes kept now (least recent first)."""
        return list(self._blocks)

    def put(self, block_hash: int, block: HostBlock) -> bool:
        """Keep ``block`` under ``block_hash`` (already kept: only marked recent); False if it can never fit."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return True
        if block.nbytes > self.capacity_bytes:
            return False
        gone = []
        while self.used_bytes + block.nbytes > self.capacity_bytes:
            old_hash, old = self._blocks.popitem(last=False)
            self.used_bytes -= old.nbytes
            gone.append(old_hash)
        self._blocks[block_hash] = block
        self.used_bytes += block.nbytes
        for listener in self.listeners:
            if gone:
                listener("removed", gone, [])
            listener("stored", [block_hash], list(block.token_ids))
        return True

    def touch(self, block_hash: int) -> bool:
        """Mark the block kept under ``block_hash`` recent; False if none is."""
        if block_hash not in self._blocks:
            return False
        self._blocks.move_to_end(block_hash)
        return True

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> HostBlock | None:
        """The block kept under ``block_hash`` holding exactly ``token_ids`` (marked recent), or None."""
        block = self._blocks.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        self._blocks.move_to_end(block_hash)
        return block
