"""One step's adapters: each token row's slot in the :class:`~fleetllm.lora.tables.LoraTables`, and the PyTorch
update that adds every row's own adapter to a projection's output. Base rows and rows of different adapters share
the step's one forward; nothing runs once per adapter but these products. Two ways, by the step's shape:

- segmented (S-LoRA's): rows grouped by slot once per step (rows of the base model, slot -1, in none), and each
  group's rows multiplied by its slot's ``A`` (a fused projection's modules in one product), then by each module's
  ``B``, added into the rows' outputs; a group holding every row skips the gather and the scatter. Wide steps
  (prefill chunks) and steps of one adapter.
- stacked: a narrow step (a decode step, at most ``DENSE_ROWS`` rows) with several adapters computes ``x`` against
  every slot's ``A`` at once (all of a fused projection's modules in one product), zeroes each row's columns of
  other slots, and multiplies by every slot's ``B`` stacked: three products per projection instead of a few per
  slot. The wasted columns cost little at decode widths, where per-call overhead dominates.

On the CPU in fp32 the C kernel of :mod:`fleetllm.kernels.lora` takes both shapes instead: rows grouped by slot
in C, every group in one call per module (faster than either at every width measured, see there); these products
serve until it is built, and other devices and dtypes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fleetllm.kernels.lora import lora_kernel
from fleetllm.lora.tables import LoraTables

DENSE_ROWS = 64  # steps of at most this many rows with two adapters or more take the stacked products
# per tables: (their version, {key: the stacked matrices of a layer's modules}) (_stacked_tables, _slot_tables)
_STACKED: weakref.WeakKeyDictionary[LoraTables, tuple[int, dict]] = weakref.WeakKeyDictionary()


@dataclass
class LoraBatch:
    """The step's per-row adapter slots (``slots`` int32 ``[rows]``, -1: the base model) over ``tables``."""

    tables: LoraTables
    slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor | None]]  # (slot, its rows; None when it holds every row of the step)
    mask: torch.Tensor | None = None  # stacked products: [rows, slots * rank], 1 on each row's own slot's columns

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
        mask = None
        if len(groups) > 1 and len(row_slots) <= DENSE_ROWS:
            cols = torch.arange(tables.max_loras * tables.rank) // tables.rank
            mask = (cols.unsqueeze(0) == slots.unsqueeze(1)).float().to(device)
        return cls(tables, slots.to(device), groups, mask)

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
        if out.dtype == torch.float32:  # the C kernel (fleetllm/kernels/lora.py) where it serves: all rows at once
            live = [(m, lo, hi) for m, lo, hi in live
                    if not lora_kernel(out[:, lo:hi], xf, t.a[layer][m], t.b[layer][m], self.slots)]
            if not live:
                return
        if self.mask is not None:
            self._stacked(layer, live, xf, out)
            return
        modules = tuple(m for m, _, _ in live)
        r = t.rank
        for slot, rows in self.groups:
            xs = xf if rows is None else xf.index_select(0, rows)
            a, bs = _slot_tables(t, layer, modules, slot)
            mid = xs @ a.T  # [rows, modules * rank]: every module's first product in one
            for j, (_, lo, hi) in enumerate(live):
                part = mid[:, j * r : (j + 1) * r]
                if rows is None and out.dtype == torch.float32:
                    out[:, lo:hi].addmm_(part, bs[j])  # no temporary for the update
                    continue
                d = (part @ bs[j]).to(out.dtype)
                if rows is None:
                    out[:, lo:hi] += d
                else:
                    out[:, lo:hi].index_add_(0, rows, d)

    def _stacked(self, layer: int, live: list[tuple[str, int, int]], x: torch.Tensor, out: torch.Tensor) -> None:
        a, bs = _stacked_tables(self.tables, layer, tuple(m for m, _, _ in live))
        width = self.mask.shape[1]
        mid = x @ a.T  # [rows, modules * slots * rank]
        mid.view(x.shape[0], len(live), width).mul_(self.mask.unsqueeze(1))
        for j, (_, lo, hi) in enumerate(live):
            part = mid[:, j * width : (j + 1) * width]
            if out.dtype == torch.float32:
                out[:, lo:hi].addmm_(part, bs[j])
            else:
                out[:, lo:hi] += (part @ bs[j]).to(out.dtype)


def _stacked_tables(t: LoraTables, layer: int, modules: tuple[str, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every slot's ``A`` of ``modules`` stacked in one matrix ``[modules * slots * rank, in]``, and each module's
    ``B`` of every slot stacked ``[slots * rank, out]``."""
    def build() -> tuple[torch.Tensor, list[torch.Tensor]]:
        width = t.max_loras * t.rank
        a = torch.cat([t.a[layer][m].reshape(width, -1) for m in modules])
        return a, [t.b[layer][m].permute(0, 2, 1).reshape(width, -1).contiguous() for m in modules]

    return _cached(t, ("all", layer, modules), build)


def _slot_tables(t: LoraTables, layer: int, modules: tuple[str, ...], slot: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One slot's ``A`` of ``modules`` stacked ``[modules * rank, in]``, and each module's ``B.T`` ``[rank, out]``."""
    def build() -> tuple[torch.Tensor, list[torch.Tensor]]:
        a = torch.cat([t.a[layer][m][slot] for m in modules])
        return a, [t.b[layer][m][slot].T.contiguous() for m in modules]

    return _cached(t, (slot, layer, modules), build)


def _cached(t: LoraTables, key: tuple, build: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``build()``'s matrices for ``t`` under ``key``, kept until the tables change (their ``version``)."""
    version, cache = _STACKED.get(t, (-1, {}))
    if version != t.version:
        cache = {}
        _STACKED[t] = (t.version, cache)
    if key not in cache:
        cache[key] = build()
    return cache[key]
