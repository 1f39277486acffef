"""A mixture-of-experts MLP: a router picks ``k`` of ``E`` experts per token, their outputs are summed by weight.

Compute is grouped by expert: the step's (token, choice) pairs are sorted by expert, and each expert that any
token chose runs one matrix product over all of its tokens. A decode step therefore reads only the chosen
experts' weights (k of E per token, fewer distinct ones as the batch grows), and a prefill chunk reads each
chosen expert once, however many of its tokens chose it. Experts are summed into each token in ascending expert
order, as HF transformers does, so exact mode reproduces its floats up to the products' own rounding.

Routers, as each family has it:

- ``softmax_topk`` (Qwen2-MoE, Qwen3-MoE, Mixtral): softmax over all experts in fp32, the top ``k``, renormalised to
  sum to 1 when ``norm_topk_prob`` (Mixtral always, Qwen3-MoE per config, Qwen2-MoE usually not).
- ``topk_softmax`` (GPT-OSS): the top ``k`` logits (the router has a bias), softmax over those ``k`` only.

Qwen2-MoE adds a shared expert every token takes, scaled by ``sigmoid(shared_expert_gate(x))``. GPT-OSS's experts
have biases and a clamped SwiGLU: ``gate <= limit``, ``-limit <= up <= limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.kernels import q8
from fleetllm.kernels.moe_experts import FusedExperts, Q4Weight
from fleetllm.models.config import ModelConfig


class MoE(nn.Module):
    """Router + stacked expert weights (``gate_up [E, 2I, H]``, ``down [E, H, I]``) + optional shared expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.inter = e, cfg.num_experts_per_tok, i
        self.router_kind, self.norm_topk = cfg.router, cfg.norm_topk_prob
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.router = nn.Linear(h, e, bias=cfg.router_bias)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False) if cfg.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(e, h), requires_grad=False) if cfg.expert_bias else None
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            from fleetllm.models.llama import MLP

            self.shared = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_gate = nn.Linear(h, 1, bias=False)
        self.expert_counts: list[int] | None = None  # tokens per expert since metrics last took them
        # Each expert's quantised (gate_up, down), each Q8_0 or Q4: set at load for a GGUF's quantised experts
        # (which then hold no fp32 weights: ``gate_up`` and ``down`` are None), or Q8_0 recovered by a quantised
        # copy (models/quant.py). Groups of fewer than ``q8_rows`` tokens take the experts kernel or the Q8_0 GEMV
        # (int16 activations), wider ones fp32 products over the expert's weights (dequantised for that product
        # when there are no fp32 ones: bit for bit the file's).
        self.q8: list[tuple[q8.Q8Weight | Q4Weight, q8.Q8Weight | Q4Weight]] | None = None
        self.q8_rows = 0
        # Those steps' whole block (router, top-k, experts, sum) in one C call where the kernel covers the layer
        # (kernels/moe_experts.py): built on the first such step, None when it does not cover it
        self._fused: FusedExperts | None | bool = False

    def set_q8_experts(self, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                       down_scale: torch.Tensor) -> None:
        """Take the experts as Q8_0 levels (int8 ``[E, 2I, H]``, ``[E, H, I]``) and their fp32 scales (one per 32
        inputs) in place of fp32 weights: a quarter of their memory. Each expert's weight is a view of these."""
        self.set_quantised_experts((gate_up, gate_up_scale), (down, down_scale))

    def set_quantised_experts(self, gate_up: tuple[torch.Tensor, ...], down: tuple[torch.Tensor, ...]) -> None:
        """Take each of the experts' two weights as Q8_0 parts (levels int8 ``[E, N, K]``, fp32 scales one per 32
        inputs) or Q4 parts (levels two a byte ``[E, N, K/2]``, factors, scales:
        :class:`fleetllm.kernels.moe_experts.Q4Weight`) in place of fp32 weights. Each expert's weight is a view."""
        for name, parts, want in (("gate_up", gate_up, self.gate_up.shape), ("down", down, self.down.shape)):
            levels = parts[0]
            shape = (*levels.shape[:-1], levels.shape[-1] * (2 if len(parts) == 3 else 1))
            if tuple(shape) != tuple(want):
                raise ValueError(f"checkpoint experts {name} of shape {tuple(shape)} where the model has {tuple(want)}")
            suffixes = ("_q4", "_f", "_d") if len(parts) == 3 else ("_q8", "_d")
            for suffix, t in zip(suffixes, parts, strict=True):
                self.register_buffer(name + suffix, t, persistent=False)
        self.gate_up = self.down = None
        self._view_q8()

    def _view_q8(self) -> None:
        b = self._buffers

        def weight(name: str, e: int) -> q8.Q8Weight | Q4Weight:
            if name + "_q4" in b:
                return Q4Weight(b[name + "_q4"][e], b[name + "_f"][e], b[name + "_d"][e])
            return q8.Q8Weight(b[name + "_q8"][e], b[name + "_d"][e])

        self.q8 = [(weight("gate_up", e), weight("down", e)) for e in range(self.num_experts)]

    def _apply(self, fn: Any, recurse: bool = True) -> MoE:
        """``.to()`` and the like replace the buffers: the per-expert views follow them."""
        super()._apply(fn, recurse)
        if "gate_up_d" in self._buffers:
            self._view_q8()
        self._fused = False  # its pointers were into the old tensors
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]``, expert ids ``[T, k]``) of each token."""
        logits = self.router(x)
        if self.router_kind == "topk_softmax":
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), idx
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx

    def _linear(self, x: torch.Tensor, e: int, which: int) -> torch.Tensor:
        """Expert ``e``'s gate_up (``which`` 0) or down (1) product, through the Q8_0 kernel where it serves."""
        bias = (self.gate_up_bias, self.down_bias)[which]
        b = None if bias is None else bias[e]
        if self.q8 is not None and x.shape[0] < self.q8_rows and isinstance(self.q8[e][which], q8.Q8Weight):
            y = q8.q8_i16_linear(x, self.q8[e][which], b)
            if y is not None:
                return y
        stacked = (self.gate_up, self.down)[which]
        return F.linear(x, self.q8[e][which].dequantize().to(x.dtype) if stacked is None else stacked[e], b)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gu = self._linear(x, e, 0)
        gate, up = gu.split(self.inter, dim=-1)
        if self.limit is None:
            act = F.silu(gate) * up
        else:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return self._linear(act, e, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fused_forward(x) if 0 < x.shape[0] < self.q8_rows and self.q8 is not None else None
        if out is None:
            out = self._experts(x)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The routed experts' sum through the C kernel; None where it does not serve (not built yet, or the
        layer not covered)."""
        if self._fused is False:
            self._fused = FusedExperts.of(self)
        if self._fused is None:
            return None
        counts = torch.zeros(self.num_experts, dtype=torch.int64)
        out = self._fused(x, counts)
        if out is not None:
            self._count(counts.tolist())
        return out

    def _count(self, counts: list[int]) -> None:
        seen = self.expert_counts
        self.expert_counts = counts if seen is None else [a + b for a, b in zip(seen, counts, strict=True)]

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum in PyTorch, grouped by expert (see the module doc)."""
        weights, idx = self.route(x)
        idx, perm = idx.sort(dim=-1)  # each token's choices in ascending expert order: the order HF sums them in
        weights = weights.gather(1, perm)
        t, k = idx.shape
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        self._count(counts)
        xs = x.index_select(0, order // k)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._expert(e, xs[start : start + n])
                start += n
        ys *= weights.flatten()[order].unsqueeze(1)
        pairs = torch.empty_like(ys)
        pairs[order] = ys  # back to (token, choice) order; index_add_ was ~10 ms a call on these CPUs
        pairs = pairs.view(t, k, -1)
        out = pairs[:, 0].clone()
        for j in range(1, k):  # one add at a time, as HF's index_add_ accumulates
            out += pairs[:, j]
        return out
