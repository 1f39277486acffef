"""Gemma 3 (text) in plain PyTorch over the same paged KV cache and attention as :mod:`fleetllm.models.llama`.

What differs from a Llama decoder: embeddings scaled by sqrt(hidden); a norm before *and after* both
attention and the MLP; GeGLU (tanh-approximated GELU) MLP; per-head q/k norms; queries scaled by
``query_pre_attn_scalar``; interleaved sliding-window layers (local RoPE base) and global layers (global
RoPE base, with the config's scaling); optional final logit softcapping; tied embeddings.

Norm weights follow HF transformers' checkpoints, which store ``weight - 1`` (Gemma normalises with
``1 + weight``): the offset is added once at load, so at run time every RMSNorm is the plain one.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from fleetllm.models.config import ModelConfig
from fleetllm.models.llama import (
    MLP,
    Attention,
    AttentionMetadata,
    RMSNorm,
    Rotary,
    check_all_used,
    load_attention_and_mlp,
    load_embeddings,
    set_weight,
    state_taker,
    uninitialised_embedding,
)


class Gemma3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sliding = cfg.is_sliding(index)
        self.input_norm = RMSNorm(h, eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(h, eps)
        self.pre_mlp_norm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.post_mlp_norm = RMSNorm(h, eps)


class Gemma3Model(nn.Module):
    """Decoder stack + tied LM head, with the interface of :class:`~fleetllm.models.llama.LlamaModel`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = uninitialised_embedding(cfg)
        self.layers = nn.ModuleList(Gemma3Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_rotary()
        self.requires_grad_(False)

    def init_rotary(self, device: str | torch.device | None = None) -> None:
        """(Re)build the RoPE tables in fp32: global layers use the config's base and scaling, local ones neither."""
        cfg = self.cfg
        local = replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta, rope_scaling=None)
        self.rotary, self.rotary_local = Rotary(cfg).to(device), Rotary(local).to(device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        aux_layers: tuple[int, ...] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(input_ids)
        h = h * torch.tensor(self.cfg.hidden_size**0.5, dtype=h.dtype)  # HF rounds the scale to the weights' dtype
        # Sliding-window layers read the window of each query only; see AttentionMetadata.within_window for why
        # the KV cache, prefix cache and KV events need nothing special for them.
        local = meta.within_window(positions, self.cfg.sliding_window) if self.cfg.sliding_window else meta
        aux = []
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_cache, strict=True)):
            m, rotary = (local, self.rotary_local) if layer.sliding else (meta, self.rotary)
            h = h + layer.post_attn_norm(layer.attn(layer.input_norm(h), positions, rotary, m, kc, vc))
            h = h + layer.post_mlp_norm(layer.mlp(layer.pre_mlp_norm(h)))
            if aux_layers and i in aux_layers:
                aux.append(h)
        if aux_layers is None:
            return self.norm(h)
        return self.norm(h), torch.cat(aux, dim=-1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights named as in HF transformers' Gemma 3 checkpoints (norms stored as ``weight - 1``)."""
        take = state_taker(sd)
        with torch.no_grad():
            load_embeddings(self, sd, take, norm_offset=1.0)
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                load_attention_and_mlp(layer, self.cfg, p, take, norm_offset=1.0)
                for norm, name in ((layer.input_norm, "input_layernorm"), (layer.post_attn_norm, "post_attention_layernorm"),
                                   (layer.pre_mlp_norm, "pre_feedforward_layernorm"),
                                   (layer.post_mlp_norm, "post_feedforward_layernorm")):
                    set_weight(norm, take(f"{p}{name}.weight") + 1.0)
        check_all_used(sd)
