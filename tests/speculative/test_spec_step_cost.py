"""The step cost adaptive K decides on: measured where the step's kernels change, through the real runner."""

from __future__ import annotations

from torch import nn

from fleetllm.engine.model_runner import ModelRunner
from fleetllm.models.quant import ByWidth
from fleetllm.speculative.step_cost import StepCost, _measure, row_sizes


def test_both_sides_of_a_kernel_bound_are_measured() -> None:
    model = nn.Sequential(ByWidth(nn.Identity(), nn.Identity(), rows=48), ByWidth(nn.Identity(), nn.Identity(), rows=8))
    assert row_sizes(model, 128) == [1, 2, 4, 7, 8, 16, 32, 47, 48, 64, 128]
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
