"""The block pool and the KV cache manager's prefix caching: ref counts, LRU reuse, hash re-checks."""

from __future__ import annotations

import pytest

from fleetllm.engine.block_pool import BlockPool, DoubleFree, hash_block, hash_prefix_blocks
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8), max_tokens=8)


def computed(kv: KVCacheManager, seq: Sequence) -> None:
    """Pretend the model computed every token the sequence holds blocks for, and cache the full blocks."""
    kv.grow(seq, seq.num_uncomputed)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)


# ---- BlockPool --------------------------------------------------------------------------------------
def test_allocate_takes_blocks_with_one_reference() -> None:
    pool = BlockPool(4, BS)
    got = pool.allocate(3)
    assert len(set(got)) == 3
    assert pool.num_free == 1
    pool.check({b: 1 for b in got})


def test_allocating_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(2, BS)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.num_free == 2
    pool.check({})


def test_release_returns_blocks_to_the_free_list() -> None:
    pool = BlockPool(4, BS)
    pool.release(pool.allocate(4))
    assert pool.num_free == 4
    assert pool.usage == 0
    pool.check({})


def test_double_free_raises() -> None:
    pool = BlockPool(2, BS)
    got = pool.allocate(1)
    pool.release(got)
    with pytest.raises(DoubleFree):
        pool.release(got)


def test_a_shared_block_is_free_only_after_its_last_reference() -> None:
    pool = BlockPool(2, BS)
    (b,) = pool.allocate(1)
    pool.register(b, 123, [1, 2, 3, 4])
    pool.touch(b)
    pool.check({b: 2})
    pool.release([b])
    pool.check({b: 1})
    pool.release([b])
    pool.check({})


def test_usage_is_the_fraction_of_blocks_in_use() -> None:
    pool = BlockPool(4, BS)
    pool.allocate(1)
    assert pool.usage == pytest.approx(0.25)


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4, BS)
    a, b, c, d = pool.allocate(4)
    pool.release([c])
    pool.release([a])
    pool.release([d])
    pool.release([b])
    assert pool.allocate(4) == [c, a, d, b]


def test_a_sequence_releases_its_tail_block_first_so_it_is_reused_first() -> None:
    pool = BlockPool(3, BS)
    table = pool.allocate(3)
    pool.release(table)
    assert pool.allocate(1) == [table[-1]]


def test_a_freed_cached_block_stays_hittable_until_reused() -> None:
    pool = BlockPool(2, BS)
    (b,) = pool.allocate(1)
    pool.register(b, 7, [1, 2, 3, 4])
    pool.release([b])
    assert pool.lookup(7, [1, 2, 3, 4]) == b
    pool.allocate(1)  # the never-used block goes first (it was freed earlier)
    assert pool.lookup(7, [1, 2, 3, 4]) == b
    pool.allocate(1)  # now the cached block is reused: its hash is forgotten
    assert pool.lookup(7, [1, 2, 3, 4]) is None
    pool.check()


def test_evicting_a_cached_block_emits_a_removed_event() -> None:
    events: list[tuple[str, list[int]]] = []
    pool = BlockPool(1, BS, on_event=lambda kind, hashes: events.append((kind, hashes)))
    (b,) = pool.allocate(1)
    pool.register(b, 7, [1, 2, 3, 4])
    pool.release([b])
    pool.allocate(1)
    assert events == [("stored", [7]), ("removed", [7])]


def test_same_hash_with_different_tokens_is_no_hit() -> None:
    pool = BlockPool(2, BS)
    (b,) = pool.allocate(1)
    pool.register(b, 99, [1, 2, 3, 4])
    assert pool.lookup(99, [1, 2, 3, 4]) == b
    assert pool.lookup(99, [4, 3, 2, 1]) is None


def test_the_first_block_registered_under_a_hash_wins() -> None:
    pool = BlockPool(2, BS)
    a, b = pool.allocate(2)
    pool.register(a, 5, [1, 2, 3, 4])
    pool.register(b, 5, [1, 2, 3, 4])
    assert pool.lookup(5, [1, 2, 3, 4]) == a
    assert pool.blocks[b].hash is None
    pool.check()


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(2, BS)
    (b,) = pool.allocate(1)
    pool.register(b, 5, [1, 2, 3, 4])
    pool.reset_prefix_cache()
    assert pool.lookup(5, [1, 2, 3, 4]) is None
    pool.check({b: 1})


def test_block_hashes_chain_on_the_parent() -> None:
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(1, [1, 2]) != hash_block(2, [1, 2])
    assert hash_block(None, [1, 2], b"model-a") != hash_block(None, [1, 2], b"model-b")
    hashes = hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert hashes == [hash_block(None, [1, 2, 3, 4]), hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])]


# ---- KVCacheManager prefix hits ---------------------------------------------------------------------
def test_a_repeated_prompt_hits_its_full_blocks() -> None:
    kv = KVCacheManager(BlockPool(16, BS))
    first = make_seq(list(range(10)), "a")
    assert kv.admit(first, 100) == 0
    computed(kv, first)
    second = make_seq(list(range(10)), "b")
    assert kv.admit(second, 100) == 8  # two full blocks of the 10-token prompt
    assert second.block_table[:2] == first.block_table[:2]
    assert second.num_computed_tokens == 8


def test_a_prefix_hit_is_capped_at_num_tokens_minus_one() -> None:
    kv = KVCacheManager(BlockPool(16, BS))
    first = make_seq(list(range(8)), "a")  # exactly two blocks
    kv.admit(first, 100)
    computed(kv, first)
    second = make_seq(list(range(8)), "b")
    # a full hit would leave nothing to compute the next token's logits from: the last block is recomputed
    assert kv.admit(second, 100) == 4
    assert second.num_uncomputed == 4


def test_prompts_sharing_a_prefix_share_its_blocks() -> None:
    kv = KVCacheManager(BlockPool(16, BS))
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    kv.admit(a, 100)
    computed(kv, a)
    b = make_seq([1, 2, 3, 4, 50, 60, 70, 80, 90], "b")
    assert kv.admit(b, 100) == 4
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]


def test_a_hit_on_a_freed_block_takes_it_off_the_free_list() -> None:
    pool = BlockPool(8, BS)
    kv = KVCacheManager(pool)
    a = make_seq(list(range(9)), "a")
    kv.admit(a, 100)
    computed(kv, a)
    kv.free(a)
    assert pool.num_free == 8
    b = make_seq(list(range(9)), "b")
    assert kv.admit(b, 100) == 8
    pool.check({bid: 1 for bid in b.block_table})


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(BlockPool(16, BS), enable_prefix_caching=False)
    a = make_seq(list(range(10)), "a")
    kv.admit(a, 100)
    computed(kv, a)
    assert kv.admit(make_seq(list(range(10)), "b"), 100) == 0


def test_different_extra_keys_never_share_blocks() -> None:
    pool = BlockPool(16, BS)
    a = make_seq(list(range(10)), "a")
    KVCacheManager(pool, extra_key=b"model-a").admit(a, 100)
    computed(KVCacheManager(pool, extra_key=b"model-a"), a)
    assert KVCacheManager(pool, extra_key=b"model-b").admit(make_seq(list(range(10)), "b"), 100) == 0


def test_admit_takes_nothing_when_blocks_are_short() -> None:
    pool = BlockPool(2, BS)
    kv = KVCacheManager(pool)
    seq = make_seq(list(range(12)), "a")  # needs 3 blocks
    assert kv.admit(seq, 100) is None
    assert seq.block_table == []
    pool.check({})


def test_admit_counts_prefix_queries_and_hits_in_tokens() -> None:
    kv = KVCacheManager(BlockPool(16, BS))
    a = make_seq(list(range(10)), "a")
    kv.admit(a, 100)
    computed(kv, a)
    kv.admit(make_seq(list(range(10)), "b"), 100)
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)


def test_grow_adds_blocks_only_when_the_last_one_is_full() -> None:
    kv = KVCacheManager(BlockPool(4, BS))
    seq = make_seq([1, 2, 3], "a")
    kv.admit(seq, 100)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 3
    seq.output_token_ids.append(4)
    assert kv.grow(seq, 1) and len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    seq.output_token_ids.append(5)
    assert kv.grow(seq, 1) and len(seq.block_table) == 2
