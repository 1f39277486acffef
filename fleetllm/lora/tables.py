"""The resident adapters' weights, stacked per layer and projection so that one step applies each row's own adapter.

The seam between the adapter registry (which decides what is resident, and in which slot) and the code that applies
adapters inside a step (the PyTorch path in ``models/`` and the C kernels in ``kernels/``): both read only this
layout.

Layout, per layer ``i`` and projection ``m`` (one of :data:`MODULES`), for the ``max_loras`` slots:

- ``a[i][m]``: float32 ``[max_loras, rank, in_features]`` (PEFT's ``lora_A.weight`` per slot),
- ``b[i][m]``: float32 ``[max_loras, out_features, rank]`` (PEFT's ``lora_B.weight`` times the adapter's scaling:
  ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA),

zero beyond an adapter's own rank and for a projection it does not adapt, so that a row's update is exactly
``x @ a[i][m][s].T @ b[i][m][s].T`` for its slot ``s``; a row without an adapter has slot ``-1`` and no update.
``rank`` is the largest rank resident (it grows, never above ``max_rank``); ``active[m]`` says whether any resident
adapter adapts ``m``, so a step skips projections no adapter touches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shapes:
    """``(in_features, out_features)`` of each projection of a decoder layer."""

    dims: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> Shapes:
        """The projections of a Llama-family layer."""
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls({"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                    "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
                    "down_proj": (intermediate, hidden)})


@dataclass(frozen=True)
class SlotWeights:
    """One adapter's matrices for one projection of one layer: ``a`` ``[r, in]``, ``b`` ``[out, r]`` (unscaled)."""

    a: torch.Tensor
    b: torch.Tensor


class LoraTables:
    """Stacked per-slot LoRA matrices for every layer and projection (the module docstring gives the layout)."""

    def __init__(self, shapes: Shapes, num_layers: int, max_loras: int, max_rank: int,
                 device: str | torch.device = "cpu") -> None:
        """``device``: where the tables live (the model's device); they stay float32 there."""
        self.shapes, self.num_layers, self.max_loras, self.max_rank = shapes, num_layers, max_loras, max_rank
        self.device = torch.device(device)
        self.rank = 0
        self.a: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.b: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.active: dict[str, bool] = {m: False for m in MODULES}
        self._modules: list[set[str]] = [set() for _ in range(max_loras)]  # per slot: the projections it adapts
        self.version = 0  # bumped on every change: code that caches pointers into the tables rebuilds them

    def set_slot(self, slot: int, weights: dict[tuple[int, str], SlotWeights], scaling: float) -> None:
        """Put an adapter in ``slot``: ``weights[(layer, module)]`` for each projection it adapts."""
        self._check_slot(slot)
        rank = max((w.a.shape[0] for w in weights.values()), default=0)
        if rank > self.max_rank:
            raise ValueError(f"adapter rank {rank} exceeds max_rank {self.max_rank}")
        self._grow(rank)
        self.clear_slot(slot)
        for (layer, module), w in weights.items():
            fan_in, fan_out = self.shapes.dims[module]
            if tuple(w.a.shape[1:]) != (fan_in,) or tuple(w.b.shape) != (fan_out, w.a.shape[0]):
                raise ValueError(f"layer {layer} {module}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not fit "
                                 f"({fan_in} -> {fan_out})")
            self._ensure(layer, module)
            r = w.a.shape[0]
            self.a[layer][module][slot, :r] = w.a.float().to(self.device)
            self.b[layer][module][slot, :, :r] = w.b.float().to(self.device) * scaling
            self._modules[slot].add(module)
        self._refresh_active()

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot`` so that it adapts nothing."""
        self._check_slot(slot)
        for layer in range(self.num_layers):
            for module in self._modules[slot]:
                self.a[layer][module][slot].zero_()
                self.b[layer][module][slot].zero_()
        self._modules[slot] = set()
        self._refresh_active()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} outside [0, {self.max_loras})")

    def _ensure(self, layer: int, module: str) -> None:
        if module not in self.a[layer]:
            fan_in, fan_out = self.shapes.dims[module]
            self.a[layer][module] = torch.zeros(self.max_loras, self.rank, fan_in, device=self.device)
            self.b[layer][module] = torch.zeros(self.max_loras, fan_out, self.rank, device=self.device)

    def _grow(self, rank: int) -> None:
        """Widen every table to ``rank`` (zero-padded): ranks only grow, so resident slots keep their values."""
        if rank <= self.rank:
            return
        for layer in range(self.num_layers):
            for module, a in self.a[layer].items():
                self.a[layer][module] = torch.nn.functional.pad(a, (0, 0, 0, rank - self.rank))
                self.b[layer][module] = torch.nn.functional.pad(self.b[layer][module], (0, rank - self.rank))
        self.rank = rank

    def _refresh_active(self) -> None:
        self.active = {m: any(m in mods for mods in self._modules) for m in MODULES}
        self.version += 1

    def delta(self, layer: int, module: str, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """The reference update for rows ``x`` ``[rows, in]`` with per-row ``slots`` ``[rows]`` (-1: none), or
        None when no resident adapter adapts ``module``: ``x @ A[s].T @ B[s].T`` per row, zero for slot -1."""
        if not self.active[module] or module not in self.a[layer]:
            return None
        on = slots >= 0
        idx = slots.clamp(min=0).long()
        mid = torch.bmm(self.a[layer][module][idx], x.unsqueeze(-1))  # [rows, rank, 1]
        out = torch.bmm(self.b[layer][module][idx], mid).squeeze(-1)  # [rows, out]
        return out * on.unsqueeze(-1).to(out.dtype)
