"""The disk tier (--kv-disk-dir): a restarted engine serves its predecessor's prefixes from disk, token-identical,
and a block whose file is damaged is recomputed, never loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetllm.engine.block_pool import hash_prefix_blocks
from fleetllm.engine.engine import LLMEngine
from fleetllm.models.loader import LoadedModel
from tests.kvtier.tier_helpers import FULL_BLOCKS, close, engine_with, flush, metric, prompt, run


@pytest.fixture
def written(loaded_model: LoadedModel, tmp_path: Path) -> tuple[Path, list[int]]:
    """A disk folder an engine (now gone) wrote one request's blocks into, and the tokens it generated."""
    engine, tiers = engine_with(loaded_model, disk_dir=tmp_path, disk_gb=0.01)
    tokens, out = run(engine, prompt(11))
    assert out.num_cached_tokens == 0
    flush(tiers)
    close(tiers)
    return tmp_path, tokens


def test_a_restarted_engine_loads_its_predecessors_prefix_from_disk(loaded_model, written) -> None:
    folder, reference = written
    engine, tiers = engine_with(loaded_model, disk_dir=folder, disk_gb=0.01)
    tokens, out = run(engine, prompt(11))
    close(tiers)
    assert out.num_cached_tokens == FULL_BLOCKS
    assert tokens == reference
    assert metric(engine, 'fleetllm:kv_tier_hits_total{tier="disk"}') == FULL_BLOCKS // 16
    assert metric(engine, 'fleetllm:kv_tier_bytes_total{direction="loaded",tier="disk"}') > 0


def block_file(folder: Path, engine: LLMEngine, ids: list[int], i: int) -> Path:
    """The file of block ``i`` of ``ids`` in a disk tier's folder."""
    h = hash_prefix_blocks(ids[: (i + 1) * 16], 16, engine.kv.extra_key)[i]
    (path,) = folder.rglob(f"{h:016x}.kvb")
    return path


def test_a_block_failing_its_checksum_is_recomputed_from_there_on(loaded_model, written) -> None:
    folder, reference = written
    engine, tiers = engine_with(loaded_model, disk_dir=folder, disk_gb=0.01)
    f = block_file(folder, engine, prompt(11), 2)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the K tensor
    f.write_bytes(bytes(data))
    tokens, out = run(engine, prompt(11))
    close(tiers)
    assert tokens == reference
    assert out.num_cached_tokens == 32  # the two blocks before it loaded, the rest computed
    assert metric(engine, 'fleetllm:kv_tier_errors_total{op="corrupt",tier="disk"}') == 1
    assert not f.exists() or f.read_bytes() != bytes(data)  # dropped (then written again, whole)


def test_a_truncated_block_file_is_recomputed(loaded_model, written) -> None:
    folder, reference = written
    engine, tiers = engine_with(loaded_model, disk_dir=folder, disk_gb=0.01)
    f = block_file(folder, engine, prompt(11), 0)
    f.write_bytes(f.read_bytes()[:-7])
    tokens, out = run(engine, prompt(11))
    close(tiers)
    assert tokens == reference
    assert out.num_cached_tokens == 0


def test_behind_the_host_tier_a_block_missing_from_host_memory_comes_from_disk(loaded_model, written) -> None:
    folder, reference = written
    engine, tiers = engine_with(loaded_model, offload_gb=0.05, disk_dir=folder, disk_gb=0.01)
    tokens, out = run(engine, prompt(11))
    close(tiers)
    assert [t.metrics.tier for t in tiers] == ["host", "disk"]
    assert out.num_cached_tokens == FULL_BLOCKS and tokens == reference
    assert metric(engine, 'fleetllm:kv_tier_misses_total{tier="host"}') == FULL_BLOCKS // 16
    assert metric(engine, 'fleetllm:kv_tier_hits_total{tier="disk"}') == FULL_BLOCKS // 16


def test_a_load_that_fails_after_the_match_is_computed_instead(loaded_model, written, monkeypatch) -> None:
    folder, reference = written
    engine, tiers = engine_with(loaded_model, disk_dir=folder, disk_gb=0.01)

    def broken(loads: object) -> None:
        raise RuntimeError("the copy into the pool failed")

    monkeypatch.setattr(tiers[0], "_load", broken)
    tokens, out = run(engine, prompt(11))
    close(tiers)
    assert tokens == reference
    assert out.num_cached_tokens == 0  # the tokens given back were computed, not counted cached
    assert metric(engine, 'fleetllm:kv_tier_errors_total{op="load",tier="disk"}') == 1


def test_a_prefix_longer_than_the_step_budget_is_loaded_whole(loaded_model, tmp_path) -> None:
    ids = prompt(13, n=300)  # the step budget is 128 tokens: loading costs none of it
    writer, w_tiers = engine_with(loaded_model, disk_dir=tmp_path, disk_gb=0.05)
    reference, _ = run(writer, ids)
    flush(w_tiers)
    close(w_tiers)
    engine, tiers = engine_with(loaded_model, disk_dir=tmp_path, disk_gb=0.05)
    tokens, out = run(engine, ids)
    close(tiers)
    assert out.num_cached_tokens == 288 and tokens == reference
