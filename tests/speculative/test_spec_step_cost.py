"""The step cost adaptive K decides on: measured where the step's kernels change, through the real runner."""

from __future__ import annotations

import os

from torch import nn

from fleetllm.engine.model_runner import ModelRunner
from fleetllm.models.quant import ByWidth
from fleetllm.speculative.step_cost import StepCost, _measure, row_sizes


def test_both_sides_of_a_kernel_bound_are_measured() -> None:
    model = nn.Sequential(ByWidth(nn.Identity(), nn.Identity(), rows=48), ByWidth(nn.Identity(), nn.Identity(), rows=8))
    assert row_sizes(model, 128) == [1, 2, 4, 7, 8, 16, 32, 47, 48, 64]  # wider: scaled from 64
    assert row_sizes(model, 40) == [1, 2, 4, 7, 8, 16, 32]


def test_a_measured_cost_never_falls_with_more_rows(loaded_model) -> None:  # type: ignore[no-untyped-def]
    runner = ModelRunner(loaded_model.model, num_blocks=4, block_size=16)
    cost = _measure(runner, [1, 2, 4])
    assert cost.sizes == [1, 2, 4]
    assert 0 < cost.times[0] <= cost.times[1] <= cost.times[2]
    assert cost.per_verify >= 0


def test_the_measure_is_taken_once_per_model_and_threads(loaded_model) -> None:  # type: ignore[no-untyped-def]
    runner = ModelRunner(loaded_model.model, num_blocks=4, block_size=16)
    assert StepCost.measure(runner, max_rows=2) is StepCost.measure(runner, max_rows=2)


def test_a_new_process_reuses_the_measure_kept_on_disk_and_other_threads_measure_again(
        loaded_model, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    from fleetllm.speculative import step_cost, step_cost_cache

    monkeypatch.setenv("FLEETLLM_CACHE_DIR", str(tmp_path))
    runner = ModelRunner(loaded_model.model, num_blocks=4, block_size=16)
    calls = []
    monkeypatch.setattr(step_cost, "_measure", lambda r, sizes: calls.append(sizes) or StepCost(sizes, [1e-3] * len(sizes)))
    first = step_cost._measure_or_cached(runner, 2)
    assert step_cost._measure_or_cached(runner, 2) == first and len(calls) == 1  # from disk: not measured again
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        step_cost._measure_or_cached(runner, 2)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2  # another thread count is another entry
    entry = tmp_path / "step-cost" / f"{step_cost_cache.key(runner, 2)}.json"
    old = entry.stat().st_mtime - step_cost_cache.MAX_AGE - 1
    os.utime(entry, (old, old))
    step_cost._measure_or_cached(runner, 2)
    assert len(calls) == 3  # a stale entry is measured again
