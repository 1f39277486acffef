"""8-bit KV pools behind the tiers: blocks stored and loaded with their scales bit for bit (host memory, disk),
token-identical to recomputing, and kept apart from other dtypes' blocks by the layout namespace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.kernels import kv8
from fleetllm.kvtier.attach import attach_tiers
from fleetllm.kvtier.codec import decode, encode
from fleetllm.kvtier.host import HostBlock
from fleetllm.models.loader import LoadedModel
from tests.kvtier.tier_helpers import FULL_BLOCKS, close, flush, prompt, run


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_8bit_block_round_trips_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    k, v = (kv8.quantize(torch.randn(2, 4, 3, 8, generator=g), dtype) for _ in range(2))
    back = decode(encode(HostBlock((1, 2, 3, 4), k, v)), (1, 2, 3, 4), dtype, (2, 4, 3, kv8.row_width(8, dtype)))
    assert back.k.dtype == dtype and torch.equal(back.k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(back.v.view(torch.uint8), v.view(torch.uint8))


def engine(loaded: LoadedModel, dtype: str, **tiers: object) -> tuple[LLMEngine, list]:
    e = LLMEngine(EngineConfig(num_blocks=24, max_num_batched_tokens=128, kv_cache_dtype=dtype), loaded=loaded)
    return e, attach_tiers(e, **tiers)  # type: ignore[arg-type]


def test_fp8_blocks_evicted_to_host_memory_come_back_token_identical(loaded_model: LoadedModel) -> None:
    e, _ = engine(loaded_model, "fp8", offload_gb=0.05)
    first, out = run(e, prompt(1))
    for k in range(4):  # four prompts that evict the first one's blocks from the 24-block pool
        run(e, prompt(k + 2), f"other-{k}")
    again, out = run(e, prompt(1), "again")
    assert out.num_cached_tokens == FULL_BLOCKS and again == first


def test_int8_blocks_on_disk_serve_an_int8_engine_and_no_fp32_one(loaded_model: LoadedModel, tmp_path: Path) -> None:
    e, tiers = engine(loaded_model, "int8", disk_dir=tmp_path, disk_gb=0.01)
    reference, _ = run(e, prompt(11))
    flush(tiers)
    close(tiers)
    e, tiers = engine(loaded_model, "int8", disk_dir=tmp_path, disk_gb=0.01)
    tokens, out = run(e, prompt(11))
    close(tiers)
    assert out.num_cached_tokens == FULL_BLOCKS and tokens == reference
    e, tiers = engine(loaded_model, "fp32", disk_dir=tmp_path, disk_gb=0.01)
    _, out = run(e, prompt(11))
    close(tiers)
    assert out.num_cached_tokens == 0  # another layout's namespace: a miss, never int8 bytes read as fp32
