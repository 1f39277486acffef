"""What the scheduler asks of the KV cache: prefix hits, slots for new tokens, freeing, caching full blocks."""

from __future__ import annotations

from fleetllm.engine.block_pool import BlockPool, block_key, hash_block
from fleetllm.engine.sequence import Sequence


class KVCacheManager:
    """Per-sequence block tables over a shared :class:`BlockPool`."""

    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True, extra_key: bytes = b"",
                 model: str | None = None) -> None:
        """``extra_key``: what base-model requests' block hashes mix in; with ``model``, :func:`block_key`'s."""
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model = model
        self.extra_key = block_key(model) if model is not None else extra_key
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def key_of(self, lora_name: str | None) -> bytes:
        """The block-hash key of a request run with adapter ``lora_name`` (None: the base model's key)."""
        if lora_name is None or self.model is None:
            return self.extra_key
        return block_key(self.model, lora_name)

    def prefix_hit(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) covering the longest prefix of ``seq``, at most num_tokens-1
        (the last token is always computed: its logits are needed)."""
        return self.cached_prefix(seq.all_token_ids[:-1], seq.lora_name)

    def cached_prefix(self, tokens: list[int], lora_name: str | None = None) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) holding the leading full blocks of ``tokens`` for a request run with
        adapter ``lora_name``, up to the first miss."""
        if not self.enable_prefix_caching:
            return [], []
        key = self.key_of(lora_name)
        bs = self.block_size
        blocks, hashes = [], []
        parent = None
        for i in range(len(tokens) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            parent = hash_block(parent, chunk, key)
            bid = self.pool.lookup(parent, chunk)
            if bid is None:
                break
            blocks.append(bid)
            hashes.append(parent)
        return blocks, hashes

    def admit(self, seq: Sequence, num_new_tokens: int, watermark_blocks: int = 0) -> int | None:
        """Give a waiting sequence its prefix hit plus blocks for ``num_new_tokens`` more tokens.

        Returns the number of tokens served from cache, or None (nothing taken) if blocks are short.
        """
        hit_blocks, hit_hashes = self.prefix_hit(seq)
        cached = len(hit_blocks) * self.block_size
        n = min(num_new_tokens, seq.num_tokens - cached)
        need = self._blocks_for(cached + n) - len(hit_blocks)
        reclaimed = sum(1 for b in hit_blocks if self.pool.blocks[b].ref_count == 0)
        if need + reclaimed > self.pool.num_free - watermark_blocks:
            return None
        for b in hit_blocks:
            self.pool.touch(b)
        seq.block_table = hit_blocks + self.pool.allocate(need)
        seq.block_hashes = hit_hashes
        seq.num_computed_tokens = cached
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += cached
        return cached

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` beyond the computed ones; False if blocks are short."""
        need = self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (cached ones stay hittable until reused)."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register each newly full, fully computed block of ``seq`` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= len(seq.block_hashes):
            return
        tokens = seq.token_ids_slice(len(seq.block_hashes) * bs, full * bs)
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        key = self.key_of(seq.lora_name)
        for j, i in enumerate(range(len(seq.block_hashes), full)):
            chunk = tokens[j * bs : (j + 1) * bs]
            prev, parent = parent, hash_block(parent, chunk, key)
            self.pool.register(seq.block_table[i], parent, chunk, prev, seq.lora_name)
            seq.block_hashes.append(parent)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
