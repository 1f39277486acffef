"""Adapter slots: pinned while running requests use them, the least recently used idle one evicted, adapters out of
memory read again from disk, an unloaded adapter's slot kept until its last request lets go."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_models import write_adapter

from fleetllm.lora.errors import LoraError
from fleetllm.lora.peft_format import ModelSpec
from fleetllm.lora.registry import LoraManager
from fleetllm.lora.tables import LoraTables, Shapes

SHAPES = Shapes.of(32, 2, 1, 16, 64)
SPEC = ModelSpec("m", 1, SHAPES)


@pytest.fixture
def manager(tmp_path: Path) -> LoraManager:
    m = LoraManager(SPEC, LoraTables(SHAPES, 1, 2, 8), max_loras=2, max_lora_rank=8, max_cpu_loras=1)
    for i, name in enumerate("abc"):
        m.load(name, write_adapter(tmp_path / name, SHAPES.dims, 1, ["q_proj"], 4, 8, seed=i))
    return m


def test_the_least_recently_used_idle_slot_is_evicted(manager: LoraManager) -> None:
    sa, sb = manager.acquire("a"), manager.acquire("b")
    manager.release(sa)
    manager.release(sb)
    manager.acquire("a")  # a used last: b is the one to go
    assert manager.acquire("c") == sb and manager.resident() == {"a": sa, "c": sb}


def test_a_slot_pinned_by_running_requests_is_never_evicted(manager: LoraManager) -> None:
    manager.acquire("a")
    manager.acquire("b")
    assert not manager.can_acquire("c")
    with pytest.raises(LoraError) as e:
        manager.acquire("c")
    assert e.value.status == 503 and manager.resident().keys() == {"a", "b"}


def test_adapters_beyond_max_cpu_loras_are_read_again_from_disk(manager: LoraManager) -> None:
    for name in "abca":
        manager.release(manager.acquire(name))
    assert manager.disk_reads >= 2  # one adapter kept in memory: the others come back from their files


def test_an_unloaded_adapters_slot_is_cleared_when_its_last_request_ends(manager: LoraManager) -> None:
    slot = manager.acquire("a")
    manager.unload("a")
    tables = manager.tables
    assert tables.a[0]["q_proj"][slot].abs().sum() > 0  # still running with it
    assert manager.acquire("b") != slot
    manager.release(slot)
    assert tables.a[0]["q_proj"][slot].abs().sum() == 0 and "a" not in manager.names()


def test_names_are_unique_and_unknown_ones_are_404(manager: LoraManager, tmp_path: Path) -> None:
    with pytest.raises(LoraError) as taken:
        manager.load("a", tmp_path / "a")
    with pytest.raises(LoraError) as unknown:
        manager.unload("zzz")
    assert (taken.value.status, unknown.value.status) == (400, 404)
