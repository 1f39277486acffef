"""KV export/import between two engines, and the frame format's integrity checks."""

from __future__ import annotations

import pytest
import torch

from fleetllm.disagg import frame
from fleetllm.disagg.kv_io import export_blocks, import_blocks
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.params import SamplingParams
from fleetllm.models.loader import LoadedModel

PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list, and explain its complexity.",
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made, sold and read across Europe; summarise the consequences in three points.",
    "List five prime numbers greater than one hundred and say how you checked each of them.",
]


@pytest.fixture(scope="module")
def engines(loaded_model: LoadedModel) -> tuple[LLMEngine, LLMEngine]:
    a = LLMEngine(EngineConfig(num_blocks=256, max_num_batched_tokens=64), loaded=loaded_model)
    b = LLMEngine(EngineConfig(num_blocks=256), loaded=loaded_model)  # same weights, its own pool and KV cache
    return a, b


def run(engine: LLMEngine, rid: str, ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, cached = [], -1
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                cached = out.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("i", [0, *(pytest.param(i, marks=pytest.mark.slow) for i in range(1, len(PROMPTS)))])
def test_decode_after_import_equals_local_prefill(engines, i):
    a, b = engines
    ids = a.tokenizer.encode(PROMPTS[i])
    local, _ = run(a, f"local{i}", ids, 12)  # colocated reference (its blocks are now cached on a)
    header, layers = export_blocks(a, ids)
    assert header.num_blocks == len(ids) // 16 and header.num_blocks >= 1
    data = b"".join(frame.encode(header, layers))
    result = import_blocks(b, *frame.decode(data))
    assert result["imported"] + result["already_cached"] == header.num_blocks
    b.pool.check()
    assert b.pool.usage == 0.0  # imported blocks sit in the prefix cache, not held by anyone
    remote, cached = run(b, f"remote{i}", ids, 12)
    assert cached == min(header.num_blocks * 16, len(ids) - 1)  # the decode side really used the imported KV
    assert remote == local


def test_blocks_already_cached_on_the_decode_side_are_not_imported_twice(engines):
    a, b = engines
    ids = a.tokenizer.encode(PROMPTS[0])
    header, layers = export_blocks(a, ids)
    result = import_blocks(b, header, layers)  # b got these blocks in the test above
    assert result["imported"] == 0 and result["already_cached"] == header.num_blocks


def test_a_frame_for_another_model_or_layout_is_refused(engines):
    a, b = engines
    header, layers = export_blocks(a, a.tokenizer.encode(PROMPTS[1]))
    header.model = "other-model"
    with pytest.raises(frame.FrameError, match="does not fit"):
        import_blocks(b, header, layers)


def _small_frame() -> bytes:
    h = frame.FrameHeader("m", 2, 1, 4, "float32", 2, [1, 2, 3, 4], [11, 22])
    layers = [(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)) for _ in range(2)]
    return b"".join(frame.encode(h, layers))


def test_frame_round_trips():
    data = _small_frame()
    header, layers = frame.decode(data)
    assert header.block_hashes == [11, 22] and layers[1][0].shape == (2, 2, 1, 4)


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "magic"])
def test_a_damaged_frame_is_rejected_whole(damage):
    data = bytearray(_small_frame())
    if damage == "flip":
        data[-40] ^= 0x01  # inside the last layer's V data
    elif damage == "truncate":
        data = data[:-13]
    elif damage == "extend":
        data += b"x"
    else:
        data[:4] = b"NOPE"
    with pytest.raises(frame.FrameError):
        frame.decode(bytes(data))
