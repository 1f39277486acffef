"""What each HF family beyond Llama/Qwen2/Qwen3 adds to a Llama config, read from its ``config.json``.

Each reader takes the config as a Llama reading of the same file (shape, RoPE, tokens) and the raw dictionary,
and returns the family's :class:`ModelConfig`. A setting the engine does not implement raises
:class:`UnsupportedModel` naming it: a model that ran without it would answer, wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fleetllm.models.config import HF_MODEL_TYPES, ModelConfig, UnsupportedModel, _gemma3_from_hf


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _window(base: ModelConfig, cfg: dict[str, Any], every_layer: bool) -> ModelConfig:
    """A sliding window on every layer (``every_layer``: Mistral, Phi-3, Mixtral), or where ``layer_types`` say."""
    window = cfg.get("sliding_window")
    if not window:
        return base
    if every_layer:
        types = ["sliding_attention"] * base.num_layers
    else:
        types = cfg.get("layer_types")
        if not types or "sliding_attention" not in types:
            return base
    return replace(base, sliding_window=int(window), layer_types=list(types))


def _qwen_moe(base: ModelConfig, cfg: dict[str, Any], arch: str) -> ModelConfig:
    step = cfg.get("decoder_sparse_step", 1) or 1
    only = set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(base.num_layers) if i in only or (i + 1) % step != 0]
    out = replace(base, architecture=arch, num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                  num_experts_per_tok=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
    if cfg.get("use_sliding_window"):
        raise UnsupportedModel(f"{arch} with use_sliding_window is not supported")
    return out


def qwen3_moe(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    return replace(_qwen_moe(base, cfg, "qwen3_moe"), qk_norm=True)


def qwen2_moe(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    out = _qwen_moe(base, cfg, "qwen2_moe")
    return replace(out, attention_bias=cfg.get("qkv_bias", True),
                   shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0))


def mixtral(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    out = replace(base, architecture="mixtral", num_experts=cfg["num_local_experts"],
                  num_experts_per_tok=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["intermediate_size"],
                  norm_topk_prob=True)
    return _window(out, cfg, every_layer=True)


def mistral(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    return _window(replace(base, architecture="mistral"), cfg, every_layer=True)


def phi3(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    partial = _rope(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    out = replace(base, architecture="phi3", partial_rotary_factor=float(partial))
    if out.rope_scaling and out.rope_scaling.get("original_max_position_embeddings") is None:
        orig = cfg.get("original_max_position_embeddings", base.max_position_embeddings)
        out.rope_scaling = {**out.rope_scaling, "original_max_position_embeddings": orig}
    return _window(out, cfg, every_layer=True)


def gpt_oss(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise UnsupportedModel(f"gpt_oss with {quant} weights is not supported (its bf16 or fp32 checkpoints are)")
    out = replace(base, architecture="gpt_oss", attention_bias=True, o_bias=True, attention_sinks=True,
                  num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                  moe_intermediate_size=cfg["intermediate_size"], router="topk_softmax", router_bias=True,
                  expert_bias=True, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                  swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    return _window(out, cfg, every_layer=False)


def gemma2(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """Gemma 2 is Gemma 3 without q/k norms, with attention soft-capping and one RoPE base for every layer."""
    theta = _rope(cfg).get("rope_theta") or cfg.get("rope_theta", 10000.0)
    g = _gemma3_from_hf({**cfg, "rope_local_base_freq": theta, "rope_theta": theta,
                         "layer_types": cfg.get("layer_types") or
                         ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(base.num_layers)]})
    if cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh")) != "gelu_pytorch_tanh":
        raise UnsupportedModel("gemma2 with an activation other than gelu_pytorch_tanh is not supported")
    return replace(g, architecture="gemma2", qk_norm=False, rope_scaling=base.rope_scaling,
                   attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                   final_logit_softcapping=cfg.get("final_logit_softcapping"),
                   query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", base.head_dim)))


FAMILIES: dict[str, Callable[[ModelConfig, dict[str, Any]], ModelConfig]] = {
    "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "mixtral": mixtral, "mistral": mistral, "phi3": phi3,
    "gpt_oss": gpt_oss, "gemma2": gemma2,
}
GEMMA_FAMILIES = ("gemma2", "gemma3")  # the Gemma decoder layout (models/gemma3.py)


def supported_model_types() -> list[str]:
    """Every HF ``model_type`` fleetllm runs."""
    return sorted([*HF_MODEL_TYPES, "gemma3", "gemma3_text", *FAMILIES])
