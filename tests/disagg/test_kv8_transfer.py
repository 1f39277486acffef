"""8-bit KV pools in P/D: a frame carries an int8 pool's rows and scales as the pool holds them, a pool of
another dtype converts on import (dequantises or quantises), and a shared int8 pool is mapped and written in
place with its own layout."""

from __future__ import annotations

import time

import pytest
import torch

from fleetllm.disagg import frame
from fleetllm.disagg.direct import PoolTarget, _lease_of
from fleetllm.disagg.kv_io import export_blocks, import_blocks
from fleetllm.disagg.shared_pool import PoolLayout, PoolMaps
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.params import SamplingParams
from fleetllm.kernels import kv8
from fleetllm.models.loader import LoadedModel

TEXT = "List three uses of copper and say why it suits each. Explain why the sky is blue in two sentences."


def prefilled(loaded: LoadedModel, dtype: str, **cfg: object) -> tuple[LLMEngine, list[int]]:
    engine = LLMEngine(EngineConfig(num_blocks=32, kv_cache_dtype=dtype, **cfg), loaded=loaded)
    ids = engine.tokenizer.encode(TEXT)
    engine.add_request("p", ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return engine, ids


def pool_rows(engine: LLMEngine, header: frame.FrameHeader, ids: list[int], layer: int = 0) -> torch.Tensor:
    bid = engine.pool.lookup(header.block_hashes[0], ids[:16])
    return engine.kv_blocks()[layer][0][bid]


@pytest.fixture(scope="module")
def int8_source(loaded_model: LoadedModel) -> tuple[frame.FrameHeader, list, list[int]]:
    """An int8 engine's prompt blocks, through a frame's bytes and back."""
    src, ids = prefilled(loaded_model, "int8")
    header, layers = export_blocks(src, ids)
    return (*frame.decode(b"".join(frame.encode(header, layers))), ids)


def test_an_int8_frame_carries_the_rows_and_scales_as_the_pool_holds_them(int8_source, loaded_model) -> None:
    header, layers, ids = int8_source
    cfg = loaded_model.config
    assert header.dtype == "int8" and header.head_dim == cfg.head_dim
    assert header.layer_bytes == header.num_blocks * 16 * cfg.num_kv_heads * kv8.row_width(cfg.head_dim, torch.int8)
    dst = LLMEngine(EngineConfig(num_blocks=32, kv_cache_dtype="int8"), loaded=loaded_model)
    assert import_blocks(dst, header, layers)["imported"] == header.num_blocks
    assert torch.equal(pool_rows(dst, header, ids).view(torch.uint8), layers[0][0][0].view(torch.uint8))


def test_an_int8_frame_is_dequantised_into_an_fp32_pool(int8_source, loaded_model) -> None:
    header, layers, ids = int8_source
    dst = LLMEngine(EngineConfig(num_blocks=32, kv_cache_dtype="fp32"), loaded=loaded_model)
    assert import_blocks(dst, header, layers)["imported"] == header.num_blocks
    assert torch.equal(pool_rows(dst, header, ids), kv8.dequantize(layers[0][0][0]))


def test_an_fp32_frame_is_quantised_into_an_fp8_pool(loaded_model) -> None:
    src, ids = prefilled(loaded_model, "fp32")
    header, layers = export_blocks(src, ids)
    dst = LLMEngine(EngineConfig(num_blocks=32, kv_cache_dtype="fp8"), loaded=loaded_model)
    assert import_blocks(dst, header, layers)["imported"] == header.num_blocks
    want = kv8.quantize(layers[0][0][0], torch.float8_e4m3fn)
    assert torch.equal(pool_rows(dst, header, ids).view(torch.uint8), want.view(torch.uint8))


def test_a_shared_int8_pool_is_mapped_with_its_layout_and_written_in_place(int8_source, loaded_model) -> None:
    header, layers, _ = int8_source
    dst = LLMEngine(EngineConfig(num_blocks=32, kv_cache_dtype="int8", kv_pool_shared=True), loaded=loaded_model)
    pool_file, maps = dst.kv_pool_file(), PoolMaps()
    try:
        layout = PoolLayout.of(dst, pool_file.path)
        assert (layout.head_dim, layout.dtype) == (loaded_model.config.head_dim, "int8")
        pool = maps.layers(layout)
        blocks, _ = _lease_of({"blocks": [5 + i for i in range(header.num_blocks)], "lease_s": 30}, header, layout)
        target = PoolTarget(header, pool, blocks, time.monotonic() + 30)
        index = torch.arange(header.num_blocks)
        for i, (k, v) in enumerate(layers):
            target.put(i, 0, k, v, index)
        got = dst.kv_blocks()[7][1][5 : 5 + header.num_blocks]  # the engine's own view of the written blocks
        assert torch.equal(got.view(torch.uint8), layers[7][1].view(torch.uint8))
    finally:
        maps.forget(layout.path)
        pool_file.close()
