"""Attention with what the fused kernels and SDPA do not take: Gemma 2's soft-capped scores and GPT-OSS's sinks.

The same queries, cache reads and masks as :class:`~fleetllm.models.llama.Attention`'s own paths (decode rows
batched, each prefill chunk on its own, sliding windows through the metadata's window view), with the
scores written out: ``scores * scale``, then ``cap * tanh(scores / cap)``, then the mask, then a softmax
over the keys and, with sinks, one more logit per head that takes its share of the probability and is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fleetllm.kernels import kv8

if TYPE_CHECKING:
    from fleetllm.models.llama import AttentionMetadata


def eager_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, softcap: float | None, sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    """Write into ``out [T, H, D]`` the attention of every query of ``q [T, H, D]`` (keys already cached)."""
    if meta.decode_idx is not None:
        b, n_keys = meta.decode_slots.shape
        flat = meta.decode_slots.flatten()
        keys = kv8.read(k_cache, flat, q.dtype).view(b, n_keys, k_cache.shape[1], -1)
        vals = kv8.read(v_cache, flat, q.dtype).view(b, n_keys, v_cache.shape[1], -1)
        qd = q[meta.decode_idx].unsqueeze(1)  # [B, 1, H, D]
        out[meta.decode_idx] = _attend(qd, keys, vals, meta.decode_mask, scale, softcap, sinks)[:, 0]
    for c in meta.prefills:
        n_q, n_ctx = c.end - c.start, c.ctx_slots.shape[0]
        keys = kv8.read(k_cache, c.ctx_slots, q.dtype).unsqueeze(0)
        vals = kv8.read(v_cache, c.ctx_slots, q.dtype).unsqueeze(0)
        q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device).unsqueeze(1)
        kv_pos = torch.arange(n_ctx, device=q.device).unsqueeze(0)
        seen = kv_pos <= q_pos  # [q, L]
        if c.window is not None:
            seen &= kv_pos > q_pos - c.window
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, float("-inf"))
        out[c.start : c.end] = _attend(q[c.start : c.end].unsqueeze(0), keys, vals, mask.view(1, 1, n_q, n_ctx),
                                       scale, softcap, sinks)[0]


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``q [B, n, H, D]`` over ``keys``/``vals [B, L, Hkv, D]`` with an additive ``mask`` broadcast to ``[B, H, n, L]``."""
    heads, kv_heads = q.shape[2], keys.shape[2]
    qh = q.transpose(1, 2)  # [B, H, n, D]
    kh = keys.to(q.dtype).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)  # [B, H, L, D]
    vh = vals.to(q.dtype).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.view(1, heads, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        both = torch.cat([scores, sink], dim=-1)
        both = both - both.amax(dim=-1, keepdim=True)
        probs = torch.softmax(both, dim=-1)[..., :-1]
    return torch.matmul(probs, vh).transpose(1, 2)  # [B, n, H, D]
