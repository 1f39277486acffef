"""KV tiers as KV connectors: what every tier shares (match, allocate, load) and the host-memory tier.

- **Match on admission**: a request admitted with a prefix hit of ``c`` tokens asks the tier for the blocks
  that follow (``get_num_new_matched_tokens``: the leading run the tier holds, by the same block-hash chain
  as the pool's prefix cache, the router's index and P/D frames); the scheduler counts them as computed
  (and cached: ``usage.prompt_tokens_details.cached_tokens``) and gives them fresh blocks. A tier hands back
  blocks already in host memory and checked (:meth:`TierConnector._find`): what fails a check is a miss,
  recomputed, never loaded.
- **Load on allocation** (``update_state_after_alloc``, engine thread): those blocks copied into the fresh pool
  blocks, one indexed copy per layer, before any step reads them; the engine then registers them in the
  prefix cache as if computed. A copy that fails gives the tokens back to the scheduler, which computes them.
- **Host memory** (``--kv-offload-gb N``, :class:`HostTierConnector`): stores on eviction (the pool's
  ``on_evict``, called before anything overwrites a reused cached block): the block's K and V for every
  layer copied into :class:`~.host.HostStore` under its hash, with its token ids. The disk and shared tiers
  (:mod:`.stored`) store when a request finishes, in the background.

A load is a copy of the very bytes the pool held, so the output is token-identical to recomputing up to
the float rounding that any prefix hit already accepts. A store that fails only costs hits (counted).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fleetllm.engine.block_pool import hash_prefix_blocks
from fleetllm.engine.kv_connector.base import KVConnectorBase
from fleetllm.kvtier.host import HostBlock, HostStore, TierListener

if TYPE_CHECKING:
    import torch

    from fleetllm.engine.kv_connector.access import BlockAccess
    from fleetllm.engine.kv_connector.base import KVCaches
    from fleetllm.engine.sequence import Sequence
    from fleetllm.kvtier.metrics import TierMetrics

log = logging.getLogger("fleetllm.kvtier")


class TierConnector(KVConnectorBase):
    """A tier's scheduler and worker sides; a tier says what it holds (:meth:`_find`) and how it stores."""

    _name = "host"  # in logs
    medium = "CPU"  # the tier's name in KV events (vLLM's ``medium``; the pool's is "GPU")
    namespace: str | None = None  # the KV layout its blocks are stored under (a stored tier: codec.namespace)

    def __init__(self, metrics: TierMetrics | None = None) -> None:
        self.metrics = metrics
        self._matched: dict[str, tuple[int, list[HostBlock]]] = {}  # request id -> (first block, blocks found)
        self._rest: dict[str, tuple[int, list[HostBlock]]] = {}  # ... those found that no pool block took yet
        self._asked: set[str] = set()  # request ids whose misses are counted (once a request)
        self._listeners: list[TierListener] = []
        self._spent_s = 0.0  # seconds spent finding and copying blocks that were loaded (engine thread)
        self._loaded_blocks = 0

    def load_s_per_block(self) -> float | None:
        """Measured seconds to bring one block back from this tier, finding (a read, a decode, a check) and
        copying it into the pool, over every block loaded so far (None before the first): the price a router
        puts on a prefix this worker holds here. Read from the server's thread without locking."""
        return self._spent_s / self._loaded_blocks if self._loaded_blocks else None

    @property
    def listeners(self) -> list[TierListener]:
        """Told as blocks enter and leave the tier (KV events); from the engine thread or the tier's writer."""
        return self._listeners

    def held(self) -> list[int]:
        """The hashes of the blocks this worker knows the tier holds, for a KV-event snapshot (engine thread)."""
        return []

    def _publish(self, kind: str, hashes: list[int], token_ids: list[int]) -> None:
        for listener in self.listeners:
            listener(kind, hashes, token_ids)

    def close(self) -> None:
        """Finish what the tier writes in the background (nothing, for host memory)."""
        return None

    def _holds_any(self) -> bool:
        """Whether the tier may hold a block (False: no need to hash a prompt to ask)."""
        return True

    def _find(self, hashes: list[int], chunks: list[tuple[int, ...]]) -> list[HostBlock]:
        """The leading run of the blocks ``hashes`` (holding ``chunks``) this tier has, checked, in memory."""
        raise NotImplementedError

    def _has(self, block_hash: int) -> bool:
        """Whether the tier holds ``block_hash`` as far as this worker knows, reading nothing."""
        raise NotImplementedError

    # ---- scheduler side -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        assert self.blocks is not None
        bs = self.blocks.pool.block_size
        ids = seq.all_token_ids[: seq.num_tokens - 1]  # as the prefix cache: the last token is always computed
        full, start = len(ids) // bs, num_computed_tokens // bs
        if start >= full or self.caches is None:
            return 0
        found: list[HostBlock] = []
        first, rest = self._rest.pop(seq.request_id, (0, []))
        if first <= start < first + len(rest):  # found before, when too few pool blocks were free: not read again
            found = rest[start - first :]
        elif self._holds_any():
            hashes = hash_prefix_blocks(ids[: full * bs], bs, self.blocks.kv.key_of(seq.lora_name))
            t0 = time.perf_counter()
            found = self._find(hashes[start:], [tuple(ids[i * bs : (i + 1) * bs]) for i in range(start, full)])
            if found:  # part of what loading them costs (a lookup that finds nothing is priced by no router)
                self._spent_s += time.perf_counter() - t0
        if self.metrics is not None and seq.request_id not in self._asked:  # asked again as blocks free up
            self.metrics.misses.inc(full - start - len(found))
        self._asked.add(seq.request_id)
        if found:
            self._matched[seq.request_id] = (start, found)
        # a request asked mid-prefill may have computed part of block ``start``: its load makes that part again
        return (start + len(found)) * bs - num_computed_tokens if found else 0

    def num_held_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        if self.blocks is None or self.caches is None or not self._holds_any():
            return 0
        bs = self.blocks.pool.block_size
        ids = seq.all_token_ids[: seq.num_tokens - 1]
        full, start = len(ids) // bs, num_computed_tokens // bs
        if start >= full:
            return 0
        n = 0
        for h in hash_prefix_blocks(ids[: full * bs], bs, self.blocks.kv.key_of(seq.lora_name))[start:]:
            if not self._has(h):
                break
            n += 1
        return (start + n) * bs - num_computed_tokens if n else 0

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        first, found = self._matched.pop(seq.request_id, (0, []))
        bs = self.blocks.pool.block_size if self.blocks is not None else 1
        n = -(-max(num_external_tokens, 0) // bs)  # a block partly counted is loaded whole: the step recomputes the rest
        if n < len(found):  # the rest found no pool blocks: the scheduler asks again as blocks free up
            self._rest[seq.request_id] = (first + n, found[n:])
        if n == 0:
            return
        try:
            self._load(list(zip(seq.block_table[first : first + n], found[:n], strict=True)))
            self._loaded_blocks += n
            if self.metrics is not None:  # counted as loaded: a match that found no blocks is asked for again
                self.metrics.hits.inc(n)
        except Exception:  # noqa: BLE001 - a load that fails is computed instead, never a failed request
            log.exception("%s KV tier: loading %d blocks failed: computing them", self._name, n)
            self._count_error("load")
            seq.num_computed_tokens -= num_external_tokens  # given back: the scheduler computes them
            self._rest.pop(seq.request_id, None)

    def request_finished(self, seq: Sequence) -> None:
        self._matched.pop(seq.request_id, None)
        self._rest.pop(seq.request_id, None)
        self._asked.discard(seq.request_id)

    def _load(self, loads: list[tuple[int, HostBlock]]) -> None:
        """Copy ``(pool block, block)`` pairs into the pool, one indexed copy per layer. On the engine thread as
        the request is admitted, into fresh blocks no step has touched yet; before the step that reads them."""
        import torch

        from fleetllm.kernels import kv8

        assert self.caches is not None
        t0 = time.perf_counter()
        layers = self.caches.layers
        index = torch.tensor([bid for bid, _ in loads], dtype=torch.long, device=layers[0][0].device)
        for i, (k, v) in enumerate(layers):
            kv8.copy_rows(k, index, torch.stack([b.k[i] for _, b in loads]))  # 8-bit rows: their bytes
            kv8.copy_rows(v, index, torch.stack([b.v[i] for _, b in loads]))
        spent = time.perf_counter() - t0
        self._spent_s += spent
        if self.metrics is not None:
            self.metrics.load_seconds.observe(spent)
            self.metrics.bytes.labels(tier=self.metrics.tier, direction="loaded").inc(sum(b.nbytes for _, b in loads))

    def _count_error(self, op: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(tier=self.metrics.tier, op=op).inc()


class HostTierConnector(TierConnector):
    """Blocks evicted from the pool kept in host memory and brought back instead of recomputed."""

    def __init__(self, capacity_bytes: int, metrics: TierMetrics | None = None, dtype: str = "auto") -> None:
        """``dtype``: how blocks are kept (``--kv-offload-dtype``): ``auto`` as the pool holds them, ``bf16`` or
        ``fp8`` (e4m3 rows with a scale per token and KV head) where that is smaller."""
        super().__init__(metrics)
        self.store = HostStore(capacity_bytes)
        self.dtype = dtype
        self._kept: torch.dtype | None = None  # the dtype blocks are kept in (None: the pool's), set with the caches

    def bind(self, blocks: BlockAccess) -> None:
        super().bind(blocks)
        blocks.pool.on_evict.append(self._evicted)

    def register_kv_caches(self, caches: KVCaches) -> None:
        super().register_kv_caches(caches)
        self._kept = kept_dtype(self.dtype, caches.layers[0][0]) if caches.layers else None

    @property
    def listeners(self) -> list[TierListener]:
        return self.store.listeners

    def held(self) -> list[int]:
        return self.store.hashes()

    def _holds_any(self) -> bool:
        return len(self.store) > 0

    def _has(self, block_hash: int) -> bool:
        return block_hash in self.store

    def _find(self, hashes: list[int], chunks: list[tuple[int, ...]]) -> list[HostBlock]:
        found: list[HostBlock] = []
        for h, chunk in zip(hashes, chunks, strict=True):
            block = self.store.get(h, chunk)
            if block is None:
                break
            found.append(block)
        return found

    # ---- store (engine thread, inside the pool's allocate) --------------------------------------------
    def _evicted(self, gone: list[tuple[int, int, tuple[int, ...]]]) -> None:
        if self.caches is None:  # no KV tensors (a simulated worker): nothing to keep
            return
        import torch

        from fleetllm.kernels import kv8

        try:
            # a block loaded from here and evicted again holds the same KV: only marked recent, not copied
            layers = self.caches.layers
            for bid, block_hash, token_ids in gone:
                if self.store.touch(block_hash):  # loaded from here and evicted again: the same KV, not copied
                    continue
                k = torch.stack([lk[bid] for lk, _ in layers]).cpu()  # a copy, [layers, block_size, heads, head_dim]
                v = torch.stack([lv[bid] for _, lv in layers]).cpu()
                if self._kept is not None:  # compressed; a load converts the rows back (kv8.copy_rows)
                    k, v = kv8.convert(k, self._kept), kv8.convert(v, self._kept)
                block = HostBlock(token_ids, k, v)
                if self.store.put(block_hash, block) and self.metrics is not None:
                    self.metrics.bytes.labels(tier=self.metrics.tier, direction="stored").inc(block.nbytes)
        except Exception:  # noqa: BLE001 - a tier that fails costs hits, never the step
            log.exception("host KV tier: storing evicted blocks failed")
            self._count_error("store")
        if self.metrics is not None:
            self.metrics.used.set(self.store.used_bytes)


def kept_dtype(name: str, cache: torch.Tensor) -> torch.dtype | None:
    """The dtype host memory keeps a block of ``cache`` in, for ``--kv-offload-dtype name`` (None: the cache's
    own): ``bf16`` or ``fp8`` only where its rows take fewer bytes than the cache's."""
    import torch

    from fleetllm.kernels import kv8

    want = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}.get(name)
    if want is None:
        return None
    d = kv8.head_dim_of(cache)

    def row_bytes(dtype: torch.dtype) -> int:
        return kv8.row_width(d, dtype) * dtype.itemsize

    return want if row_bytes(want) < row_bytes(cache.dtype) else None
