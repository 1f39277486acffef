"""The disk and shared tiers as KV connectors: blocks stored as checksummed bytes, written in the background.

- **Store when a request finishes** (engine thread): its full, computed blocks still cached in the pool
  (their KV intact: nothing reuses a freed block before the next allocation, on this thread) are copied out,
  one gather per layer, and queued for the tier's :class:`~.writer.Writer`, which encodes and writes them off
  the step's path. Blocks this tier already holds (written or loaded by it) are skipped.
- **Find on admission**: the tier's ``get_many`` returns the stored bytes of the candidate blocks (the disk:
  files read; Redis: one ``MGET``); each is decoded and checked (:func:`~.codec.decode`: checksum, length,
  layout, tokens); the run stops at the first missing or bad block, which is recomputed, never loaded (a
  bad one is counted as an error, and dropped where the tier can). A tier that raises (Redis down or past
  its deadline) is a miss for the whole request, counted as an error.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from fleetllm.engine.block_pool import hash_prefix_blocks
from fleetllm.kvtier.codec import CorruptBlock, decode
from fleetllm.kvtier.connector import TierConnector
from fleetllm.kvtier.host import HostBlock
from fleetllm.kvtier.remote import Unavailable
from fleetllm.kvtier.writer import Put, Writer

if TYPE_CHECKING:
    from fleetllm.engine.sequence import Sequence
    from fleetllm.kvtier.metrics import TierMetrics

log = logging.getLogger("fleetllm.kvtier")

GetMany = Callable[[list[int]], list["bytes | None"]]  # the stored bytes of each hash (None: absent)
_KNOWN = 1 << 16  # hashes remembered as held by the tier (so a finished request's blocks are not rewritten)


class StoredTierConnector(TierConnector):
    """A tier whose blocks are bytes behind ``get_many`` and ``put`` (``drop``: forget a bad one, if it can;
    ``held``: the hashes it holds, where it can list them, and ``has`` whether it holds one; else those this
    worker wrote or loaded).

    KV events (:attr:`listeners`, as ``medium``): a block is ``stored`` once its write succeeded (on the
    writer's thread), ``removed`` when the store evicts it (:meth:`gone`) or a lookup finds absent a block
    this worker knew there (a Redis that evicted or lost it): the block is then written again the next time
    a request holding it finishes."""

    def __init__(self, name: str, get_many: GetMany, put: Put, metrics: TierMetrics | None = None,
                 drop: Callable[[int], None] | None = None, medium: str = "DISK",
                 held: Callable[[], list[int]] | None = None, has: Callable[[int], bool] | None = None) -> None:
        super().__init__(metrics)
        self._name, self.medium = name, medium
        self._get_many, self._drop, self._held, self._holds = get_many, drop, held, has
        self._known: OrderedDict[int, None] = OrderedDict()
        self._known_lock = threading.Lock()  # the engine thread remembers, the writer's thread forgets
        self.writer = Writer(name, put, lambda: self._count_error("store"), self._written)

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        self.writer.close()

    def held(self) -> list[int]:
        if self._held is not None:
            return self._held()
        with self._known_lock:
            return list(self._known)

    def gone(self, hashes: list[int]) -> None:
        """The store no longer holds ``hashes`` (evicted, or found absent): forgotten, and published removed."""
        with self._known_lock:
            known = [h for h in hashes if self._known.pop(h, 0) is None]
        if known or self._held is not None:
            self._publish("removed", known if self._held is None else hashes, [])

    def _has(self, block_hash: int) -> bool:
        if self._holds is not None:
            return self._holds(block_hash)
        with self._known_lock:
            return block_hash in self._known

    # ---- find (scheduler side) ------------------------------------------------------------------------
    def _find(self, hashes: list[int], chunks: list[tuple[int, ...]]) -> list[HostBlock]:
        assert self.caches is not None
        k0 = self.caches.layers[0][0]
        shape = (len(self.caches.layers), *k0.shape[1:])
        try:
            values = self._get_many(hashes)
        except Exception as e:  # noqa: BLE001 - a tier down or slow is a miss, never a failed request
            if not isinstance(e, Unavailable):  # logged once per back-off, not once per request
                log.warning("%s KV tier: lookup failed (%s): computing instead", self._name, e)
            self._count_error("load")
            return []
        found: list[HostBlock] = []
        for h, chunk, data in zip(hashes, chunks, values, strict=False):
            if data is None:
                if h in self._known:  # written or loaded here before: the store lost it since
                    self.gone([h])
                break
            try:
                found.append(decode(data, chunk, k0.dtype, shape))
            except CorruptBlock as e:
                log.warning("%s KV tier: block %016x is unusable (%s): computing it", self._name, h, e)
                self._count_error("corrupt")
                if self._drop is not None:
                    self._drop(h)
                break
            self._remember(h)
        return found

    # ---- store (engine thread, when a request finishes) ------------------------------------------------
    def request_finished(self, seq: Sequence) -> None:
        super().request_finished(seq)
        if self.caches is None or self.blocks is None:
            return
        try:
            self._save(seq)
        except Exception:  # noqa: BLE001 - a tier that fails costs hits, never the request
            log.exception("%s KV tier: copying a finished request's blocks failed", self._name)
            self._count_error("store")

    def _save(self, seq: Sequence) -> None:
        import torch

        assert self.caches is not None and self.blocks is not None
        pool, bs = self.blocks.pool, self.blocks.pool.block_size
        ids = seq.all_token_ids[: min(seq.num_computed_tokens, seq.num_tokens)]
        todo: list[tuple[int, int, tuple[int, ...]]] = []
        for i, h in enumerate(hash_prefix_blocks(ids, bs, self.blocks.kv.key_of(seq.lora_name))):
            bid = pool.cached.get(h)
            chunk = tuple(ids[i * bs : (i + 1) * bs])
            if h not in self._known and bid is not None and pool.blocks[bid].token_ids == chunk:
                todo.append((h, bid, chunk))
        if not todo:
            return
        layers = self.caches.layers
        index = torch.tensor([bid for _, bid, _ in todo], dtype=torch.long, device=layers[0][0].device)
        k = torch.stack([lk.index_select(0, index) for lk, _ in layers], dim=1).cpu()  # [n, layers, bs, h, d]
        v = torch.stack([lv.index_select(0, index) for _, lv in layers], dim=1).cpu()
        for j, (h, _, chunk) in enumerate(todo):
            if self.writer.submit(h, HostBlock(chunk, k[j], v[j])):
                self._remember(h)

    def _remember(self, block_hash: int) -> None:
        with self._known_lock:
            self._known[block_hash] = None
            self._known.move_to_end(block_hash)
            if len(self._known) > _KNOWN:
                self._known.popitem(last=False)

    def _written(self, block_hash: int, block: HostBlock, nbytes: int) -> None:
        """A block's write succeeded (the writer's thread)."""
        if self.metrics is not None:
            self.metrics.bytes.labels(tier=self.metrics.tier, direction="stored").inc(nbytes)
        self._publish("stored", [block_hash], list(block.token_ids))
