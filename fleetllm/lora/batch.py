"""One step's adapters: each token row's slot in the :class:`~fleetllm.lora.tables.LoraTables`, and the PyTorch
update that adds every row's own adapter to a projection's output (S-LoRA's segmented products, done per slot).

The rows of one step are grouped by slot once (at most ``max_loras`` groups; rows of the base model, slot -1,
in none), and each projection then costs two small products per group: ``x[rows] @ A[s].T @ B[s].T``, added
into the rows' outputs. A group holding every row of the step skips the gather and the scatter. Base rows and
rows of different adapters share the step's one forward; nothing runs once per adapter but these products.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleetllm.lora.tables import LoraTables


@dataclass
class LoraBatch:
    """The step's per-row adapter slots (``slots`` int32 ``[rows]``, -1: the base model) over ``tables``."""

    tables: LoraTables
    slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor | None]]  # (slot, its rows; None when it holds every row of the step)

    @classmethod
    def of(cls, tables: LoraTables | None, row_slots: Sequence[int], device: str | torch.device = "cpu") -> LoraBatch | None:
        """The step's batch for per-row ``row_slots``, or None when no row has an adapter (the base model's step)."""
        if tables is None or all(s < 0 for s in row_slots):
            return None
        slots = torch.tensor(row_slots, dtype=torch.int32)
        groups: list[tuple[int, torch.Tensor | None]] = []
        for s in sorted(set(row_slots) - {-1}):
            rows = (slots == s).nonzero().flatten()
            groups.append((s, None if len(rows) == len(slots) else rows.to(device)))
        return cls(tables, slots.to(device), groups)

    @property
    def has_adapters(self) -> bool:
        """Whether any row of the step has an adapter (a batch is only built when one does)."""
        return bool(self.groups)

    def add(self, layer: int, parts: Sequence[tuple[str, int, int]], x: torch.Tensor, out: torch.Tensor) -> None:
        """Add each row's update of the projections ``parts`` (module, first and last output column of ``out``
        it fills: a fused qkv or gate_up output takes several) to ``out`` ``[rows, cols]``, for inputs ``x``."""
        t = self.tables
        live = [(m, lo, hi) for m, lo, hi in parts if t.active[m] and m in t.a[layer]]
        if not live:
            return
        xf = x if x.dtype == torch.float32 else x.float()
        for slot, rows in self.groups:
            xs = xf if rows is None else xf.index_select(0, rows)
            for module, lo, hi in live:
                d = (xs @ t.a[layer][module][slot].T) @ t.b[layer][module][slot].T
                d = d.to(out.dtype)
                if rows is None:
                    out[:, lo:hi] += d
                else:
                    out[:, lo:hi].index_add_(0, rows, d)
