"""vLLM's block hashes and KV-event wire format, checked against vectors computed with vLLM's own code.

tests/data/vllm_block_hashes.json was written by running vLLM's ``hash_block_tokens``, ``init_none_hash``,
``sha256`` / ``sha256_cbor`` and its msgspec event structs (extracted into a scratch script outside this repo,
commits named in the file) under two ``PYTHONHASHSEED`` values.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from fleetllm.router.backends.vllm_hash import VllmHasher, external_hash
from fleetllm.router.backends.vllm_wire import (
    CLEARED,
    REMOVED,
    STORED,
    cleared_event,
    decode_batch,
    encode_batch,
    removed_event,
    stored_event,
)

DATA = json.loads((Path(__file__).parent.parent / "data" / "vllm_block_hashes.json").read_text())
CASES = [(seed, algo, name) for seed, algos in DATA["by_seed"].items() for algo in algos for name in DATA["prompts"]]


@pytest.mark.parametrize(("seed", "algo", "prompt"), CASES)
def test_block_hashes_equal_vllms(seed: str, algo: str, prompt: str) -> None:
    want = DATA["by_seed"][seed][algo]
    h = VllmHasher(algo, seed, DATA["block_size"])
    assert h.none_hash.hex() == want["none_hash"]
    tokens = DATA["prompts"][prompt]
    assert [d.hex() for d in h.digests(tokens)] == want["prompts"][prompt]["digests"]
    assert h.hashes(tokens) == want["prompts"][prompt]["ints"]


def test_seed_and_algorithm_change_every_hash() -> None:
    tokens = DATA["prompts"]["chat_64"]
    base = VllmHasher("sha256", "0").hashes(tokens)
    assert set(base).isdisjoint(VllmHasher("sha256", "1234").hashes(tokens))
    assert set(base).isdisjoint(VllmHasher("sha256_cbor", "0").hashes(tokens))
    assert VllmHasher("sha256", "0", block_size=32).hashes(tokens) != base[::2]


def test_every_recorded_event_shape_decodes() -> None:
    """Maps (current vLLM), an array batch of map events, all arrays (older vLLM), and raw-digest hashes."""
    ints = DATA["by_seed"]["0"]["sha256"]["prompts"]["ramp_40"]["ints"]
    for shape, b64 in DATA["events"]["payloads_b64"].items():
        ts, events = decode_batch(base64.b64decode(b64))
        assert ts == 1.5, shape
        assert events[0].kind == STORED and events[0].hashes == ints, shape
        assert events[0].token_ids == DATA["prompts"]["ramp_40"][:32] and events[0].block_size == 16, shape
        if len(events) > 1:
            assert [(e.kind, e.hashes) for e in events[1:]] == [(REMOVED, [ints[1]]), (CLEARED, [])], shape


def test_published_batch_is_byte_identical_to_vllms() -> None:
    ints = DATA["by_seed"]["0"]["sha256"]["prompts"]["ramp_40"]["ints"]
    ours = encode_batch(1.5, [stored_event(ints, None, DATA["prompts"]["ramp_40"][:32], 16),
                              removed_event([ints[1]]), cleared_event()])
    assert ours == base64.b64decode(DATA["events"]["payloads_b64"]["current_0181ea31"])


def test_external_hash_of_a_digest_is_its_low_64_bits() -> None:
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert external_hash(2**70 + 5) == 5
