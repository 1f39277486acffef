"""A block's stored form and the disk store: exact round trip, damage refused, LRU by bytes across restarts."""

from __future__ import annotations

import threading

import pytest
import torch

from fleetllm.kvtier.codec import CorruptBlock, decode, encode, namespace
from fleetllm.kvtier.disk import DiskStore
from fleetllm.kvtier.host import HostBlock

SHAPE = (2, 4, 3, 5)  # layers, block size, kv heads, head dim
TOKENS = (7, 8, 9, 10)


def block(dtype: torch.dtype = torch.bfloat16) -> HostBlock:
    g = torch.Generator().manual_seed(0)
    return HostBlock(TOKENS, torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_round_trips_bit_for_bit(dtype: torch.dtype) -> None:
    b, back = block(dtype), decode(encode(block(dtype)), TOKENS, dtype, SHAPE)
    assert torch.equal(back.k, b.k) and torch.equal(back.v, b.v) and back.token_ids == TOKENS


@pytest.mark.parametrize("damage", ["flipped", "truncated", "other tokens", "other dtype", "other shape"])
def test_stored_bytes_that_are_not_the_block_asked_for_are_refused(damage: str) -> None:
    data, tokens, dtype, shape = bytearray(encode(block())), TOKENS, torch.bfloat16, SHAPE
    if damage == "flipped":
        data[-3] ^= 0x01
    elif damage == "truncated":
        data = data[:-2]
    elif damage == "other tokens":
        tokens = (7, 8, 9, 11)
    elif damage == "other dtype":
        dtype = torch.float16
    else:
        shape = (2, 4, 3, 6)
    with pytest.raises(CorruptBlock):
        decode(bytes(data), tokens, dtype, shape)


def test_layouts_that_differ_in_anything_get_different_namespaces() -> None:
    base = ("m", "rev1", "bfloat16", 16, (30, 3, 64))
    variants = [("m2", *base[1:]), ("m", "rev2", *base[2:]), ("m", "rev1", "float32", *base[3:]),
                ("m", "rev1", "bfloat16", 32, base[4]), ("m", "rev1", "bfloat16", 16, (30, 3, 128))]
    assert len({namespace(*base), *(namespace(*v) for v in variants)}) == 6


def test_the_disk_store_drops_the_least_recently_used_and_keeps_its_order_across_a_restart(tmp_path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=300)
    for h in (1, 2, 3):
        store.put(h, bytes(100))
    assert store.get(1) is not None  # 1 is now the most recent: 2 goes first
    store.put(4, bytes(100))
    assert 2 not in store and not store.path(2).exists()
    again = DiskStore(tmp_path, capacity_bytes=200)  # a restart with less room: the oldest file (3) goes
    assert sorted(h for h in (1, 2, 3, 4) if h in again) == [1, 4]
    assert again.get(1) == bytes(100) and again.used_bytes == 200


def test_the_writer_drops_blocks_past_its_queued_bytes_rather_than_growing() -> None:
    from fleetllm.kvtier.writer import Writer

    gate, written = threading.Event(), []
    writer = Writer("test", lambda h, data: (gate.wait(), written.append(h)), lambda: None, lambda h, b, n: None,
                    max_pending_bytes=2 * block().nbytes)
    accepted = [writer.submit(h, block()) for h in range(4)]  # the thread holds the first until the gate opens
    gate.set()
    writer.close()
    assert accepted == [True, True, False, False] and written == [0, 1]
