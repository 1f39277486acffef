"""The decode side of a P/D transfer in the fleet simulator: importing the KV frame takes time and CPU.

A decode worker verifies each layer of an arriving frame (CRC) and copies it into pool blocks, on a thread
beside its engine's steps (:mod:`fleetllm.disagg.decode_side`). Layers are sealed and shipped as the prefill's
last step computes them, and imported in order as they come, so the import of layer ``j`` starts once
both layer ``j`` is in and layer ``j - 1`` is imported. With the last step from ``a`` to ``b`` over ``L``
layers (``c = (b - a) / L`` per layer) and an import of ``s`` seconds (``d = s / L`` per layer), the last
layer is imported at ``max(b + d, a + c + s)``: the request's first decode step waits until then.

The import's seconds are CPU seconds: on a CPU worker they come out of the core the decode steps run on,
so the steps overlapping the import take ``steal × s`` longer in all (``steal`` measured, ~1 on one core;
0 where the import runs beside the compute, as a DMA into accelerator memory does). Both parameters come
from the measured profile (``fleetllm calibrate``, :mod:`fleetllm.disagg.import_cost`); an unmeasured
import (rate 0) is free, as it was before it was modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetllm.recommend.perf_model import StepModel


@dataclass(frozen=True)
class KvImport:
    """The decode side's import: verify and copy at ``bytes_per_s`` (0: free), ``steal`` of it lost by decode steps."""

    bytes_per_s: float = 0.0
    steal: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """CPU seconds of verifying and copying ``nbytes`` of frame."""
        return nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0


@dataclass(frozen=True)
class FrameImport:
    """A model's frames on one decode replica: only a prompt's full blocks travel, every layer's K and V."""

    cost: KvImport = KvImport()
    bytes_per_token: float = 0.0
    layers: int = 1
    block_size: int = 16

    def seconds(self, prompt_tokens: int) -> float:
        """The import's seconds for a prompt of ``prompt_tokens``."""
        return self.cost.seconds(prompt_tokens // self.block_size * self.block_size * self.bytes_per_token)

    def exposed(self, prompt_tokens: int, last_step_s: float) -> float:
        """How long after the prefill's last step (of ``last_step_s``) the import ends."""
        return import_window(self.seconds(prompt_tokens), self.layers, 0.0, last_step_s)[1] - last_step_s


def frame_import(step: StepModel, block_size: int = 16) -> FrameImport:
    """The frames of the model ``step`` times (its KV bytes per token and layers), imported as it measured."""
    shape = getattr(step, "shape", None)
    return FrameImport(step.kv_import, getattr(step, "kv_bytes_per_token", 0.0), shape.layers if shape else 1,
                       block_size)


def import_window(import_s: float, layers: int, step_start: float, step_end: float) -> tuple[float, float]:
    """When the import of a frame runs, for a prefill whose last step ran from ``step_start`` to ``step_end``:
    (from the first layer's arrival, to the last layer imported)."""
    if import_s <= 0:
        return step_end, step_end
    per_layer = (step_end - step_start) / max(layers, 1)
    start = step_start + per_layer
    return start, max(step_end + import_s / max(layers, 1), start + import_s)


@dataclass
class ImportLoad:
    """The imports under way on one decode replica, and the step time they take from it."""

    windows: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, stolen s per s)

    def add(self, start: float, end: float, stolen_s: float) -> None:
        """An import running from ``start`` to ``end`` that takes ``stolen_s`` from the steps overlapping it."""
        if stolen_s > 0 and end > start:
            self.windows.append((start, end, stolen_s / (end - start)))

    def stolen(self, t0: float, t1: float) -> float:
        """Seconds a step from ``t0`` to ``t1`` loses to the imports overlapping it (older ones forgotten)."""
        self.windows = [w for w in self.windows if w[1] > t0]
        return sum(max(0.0, min(t1, end) - max(t0, start)) * rate for start, end, rate in self.windows)
