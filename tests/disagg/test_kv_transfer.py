"""KV export/import between two engines, and the frame format's integrity checks."""

from __future__ import annotations

import pytest
import torch

from fleetllm.disagg import frame
from fleetllm.disagg.connector import pd_connector
from fleetllm.disagg.kv_io import export_blocks, frame_header, import_blocks
from fleetllm.disagg.layer_stream import LayerStream
from fleetllm.engine.block_pool import hash_prefix_blocks
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
    # fp32 pools (whatever auto is on the fast path): these tests convert frames between fp32 and half precision
    a = LLMEngine(EngineConfig(num_blocks=256, max_num_batched_tokens=64, kv_cache_dtype="fp32"), loaded=loaded_model)
    b = LLMEngine(EngineConfig(num_blocks=256, kv_cache_dtype="fp32"), loaded=loaded_model)  # same weights, own pool
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


def _streamed(engine: LLMEngine, label: str, ids: list[int], dtype: str | None = None) -> tuple[bytes, list[int]]:
    """The frame a P/D prefill builds of ``ids`` while it computes (a layer hook per decoder layer), and its token."""
    header = frame_header(engine, ids, hash_prefix_blocks(ids, 16, engine.kv.extra_key), dtype)
    fb = frame.FrameBuffer(header, bytearray(header.frame_bytes()))
    stream = LayerStream(fb)
    pd_connector(engine).observe(label, stream)
    try:
        tokens, _ = run(engine, label, ids, 1)
        stream.done.result(timeout=30)  # the last layer's seal ends the frame
    finally:
        pd_connector(engine).observe(label, None)
        stream.close()
    return bytes(fb.mv), tokens


def test_a_frame_streamed_layer_by_layer_during_a_chunked_prefill_equals_the_exported_one(engines):
    a, b = engines
    ids = a.tokenizer.encode(PROMPTS[1] + " Answer in French.")  # fresh: computed in 64-token chunks on a
    data, _ = _streamed(a, "pd-stream", ids)
    assert data == b"".join(frame.encode(*export_blocks(a, ids)))
    header, layers = frame.decode(bytearray(data))
    result = import_blocks(b, header, layers)
    assert result["imported"] + result["already_cached"] == len(ids) // 16
    b.pool.check()


def test_a_stream_given_after_the_first_chunk_still_builds_the_whole_frame(engines):
    a, _ = engines
    ids = a.tokenizer.encode(" ".join(reversed(PROMPTS)) + " Keep each answer to a line or two, plain words.")
    assert len(ids) > 64 + 16
    header = frame_header(a, ids, hash_prefix_blocks(ids, 16, a.kv.extra_key))
    fb = frame.FrameBuffer(header, bytearray(header.frame_bytes()))
    stream = LayerStream(fb)
    a.add_request("pd-late", ids, SamplingParams(max_tokens=1, temperature=0.0))
    assert a.prompt_pending("pd-late") and not a.prompt_pending("pd-other")
    a.step()  # the first chunk, seen by nobody
    assert a.prompt_pending("pd-late")
    pd_connector(a).observe("pd-late", stream)  # its first step writes the blocks computed before it
    try:
        while a.has_unfinished():
            a.step()
        stream.done.result(timeout=30)
    finally:
        pd_connector(a).observe("pd-late", None)
        stream.close()
    assert not a.prompt_pending("pd-late")
    assert bytes(fb.mv) == b"".join(frame.encode(*export_blocks(a, ids)))


def test_decode_reads_the_frame_in_place(engines):
    a, _ = engines
    data = bytearray(b"".join(frame.encode(*export_blocks(a, a.tokenizer.encode(PROMPTS[0])))))
    _, layers = frame.decode(data)
    start = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert start <= layers[-1][1].data_ptr() < start + len(data)  # a view over the bytes, no copy


def test_a_half_precision_frame_of_an_fp32_pool_has_half_the_bytes_and_imports_rounded(engines):
    a, b = engines
    ids = a.tokenizer.encode("Be brief. " + PROMPTS[2])  # no block of it on b yet
    full, _ = _streamed(a, "pd-fp32", ids)
    half, _ = _streamed(a, "pd-fp16", ids, "float16")
    header, layers = frame.decode(half)
    assert header.dtype == "float16" and len(half) < 0.51 * len(full) + len(header.head())
    result = import_blocks(b, header, layers)
    assert result["imported"] == header.num_blocks
    ids_b, _ = b.kv.cached_prefix(ids)
    k_b = b.kv_blocks()[0][0][torch.tensor(ids_b)]
    assert torch.equal(k_b, layers[0][0].float())  # fp16 on the wire, converted into the fp32 pool


def test_a_layer_checksum_is_crc32c_of_its_k_and_v_bytes():
    from crc32c import crc32c

    data = _small_frame()
    r = frame.FrameReader(data)
    k, v = r.layer(0)
    stored = int.from_bytes(data[r.end_of(-1) : r.end_of(-1) + 4], "little")  # the first layer's CRC field
    assert stored == crc32c(v.numpy().tobytes(), crc32c(k.numpy().tobytes()))


@pytest.mark.parametrize("scattered", [False, True])
def test_write_fills_exactly_the_reserved_blocks(scattered):
    from fleetllm.disagg.kv_io import Reservation, write

    header = frame.FrameHeader("m", 2, 1, 4, "float32", 2, list(range(24)), list(range(12)))
    layers = [(torch.randn(12, 2, 1, 4), torch.randn(12, 2, 1, 4)) for _ in range(2)]
    src = [0, 2, 3, 4, 5, 7, 8, 9, 10, 11] if scattered else [2, 3, 4, 5, 6, 7]
    dst = [40 - 3 * i for i in range(len(src))] if scattered else [20 + i for i in range(len(src))]  # >8 runs or 1
    res = Reservation(header, [(s, 0, [], None) for s in src], dst)
    assert len(res.runs()) == (len(src) if scattered else 1)
    views = [(torch.zeros(64, 2, 1, 4), torch.zeros(64, 2, 1, 4, dtype=torch.bfloat16)) for _ in range(2)]
    write(views, layers, res)
    for (kc, vc), (k, v) in zip(views, layers, strict=True):
        assert torch.equal(kc[dst], k[src]) and torch.equal(vc[dst], v[src].to(torch.bfloat16))
        others = [b for b in range(64) if b not in dst]
        assert not kc[others].any() and not vc[others].any()


def test_a_shared_memory_file_is_mapped_once_while_it_lasts(tmp_path):
    from fleetllm.disagg.arrival import Mappings

    maps, a, b, c = Mappings(keep=2), tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_bytes(b"x" * 100)
    first = maps.map(a, 10)
    a.write_bytes(b"y" * 100)  # the sender's next frame in the same file: seen through the same mapping
    again = maps.map(a, 20)
    assert bytes(again) == b"y" * 20 and len(first) == 10 and len(maps._maps) == 1
    a.unlink()
    a.write_bytes(b"w" * 100)  # a new file under the old name (the old one still mapped): mapped anew
    assert bytes(maps.map(a, 5)) == b"wwwww"
    b.write_bytes(b"z" * 50)
    c.write_bytes(b"z" * 50)
    maps.map(b, None)
    maps.map(c, None)
    assert list(maps._maps) == [b, c]  # keep=2: the oldest mapping dropped
    c.unlink()
    maps.map(a, 1)
    assert list(maps._maps) == [b, a]  # a removed file's mapping goes
    with pytest.raises(ValueError):
        maps.map(a, 101)
