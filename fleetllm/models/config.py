"""Architecture description of a decoder (the Llama family, its mixture-of-experts relatives, Gemma 2 and 3),
read from HF config.json or GGUF metadata.

Anything fleetllm cannot run exactly — another architecture, a RoPE scaling it does not apply — raises
:class:`UnsupportedModel` naming it, here at load: a model that ran as a near-Llama would answer, wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # besides models/hf_families.py's
ROPE_SCALINGS = ("default", "linear", "llama3", "yarn", "longrope")  # what models/rope.py computes
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe", "gpt-oss")
# llama.cpp's name -> HF model_type where they differ (llama.cpp writes Mistral as llama, Mixtral as llama with experts)
GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
GGUF_ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")  # the GGUF metadata fleetllm maps


class UnsupportedModel(ValueError):
    """The model's architecture or one of its settings is not implemented by fleetllm."""


def _check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ROPE_SCALINGS:
        raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
    return scaling


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder: Llama family (Llama, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3), its
    mixture-of-experts relatives (Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS), Gemma 2 or Gemma 3.

    The fields after ``eos_token_ids`` describe what some families add; their defaults describe a Llama model.
    """

    architecture: str  # a HF model_type: "llama", "qwen2", "qwen3", "gemma3", "mixtral", ... (hf_families.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power; None: head_dim
    sliding_window: int | None = None  # keys a sliding-window layer's query sees, itself included
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention"; None: all full
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (unscaled)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores -> cap * tanh(scores / cap)
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins every softmax, then is dropped
    o_bias: bool = False  # GPT-OSS: the attention output projection has a bias
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that rotate (Phi-3 family)
    # Mixture of experts (num_experts 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router: str = "softmax_topk"  # "softmax_topk" (Qwen, Mixtral) or "topk_softmax" (GPT-OSS: softmax of the k chosen)
    norm_topk_prob: bool = False  # softmax_topk: the k chosen weights renormalised to sum to 1
    router_bias: bool = False
    expert_bias: bool = False  # the experts' projections have biases (GPT-OSS)
    swiglu_limit: float | None = None  # GPT-OSS's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * glu
    swiglu_alpha: float = 1.0  # ... glu = gate * sigmoid(alpha * gate)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, scaled by a sigmoid gate
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP in a mixture-of-experts model

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends only to the last ``sliding_window`` positions."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a HF ``config.json`` dictionary."""
        model_type = cfg.get("model_type")
        from fleetllm.models.hf_families import FAMILIES, supported_model_types

        if model_type in ("gemma3_text", "gemma3"):
            return _gemma3_from_hf(cfg.get("text_config") or cfg)
        if model_type in FAMILIES:
            act = cfg.get("hidden_act") or "silu"
            if model_type != "gemma2" and act != "silu":
                raise UnsupportedModel(f"{model_type} with hidden_act {act!r} is not supported (silu)")
            base = cls.from_hf({**cfg, "model_type": "llama"})
            return FAMILIES[model_type](base, cfg)
        if model_type not in HF_MODEL_TYPES:
            named = f"model_type {model_type!r}" if model_type else "a config.json without model_type"
            raise UnsupportedModel(f"{named} (architectures {cfg.get('architectures')}) is not supported; fleetllm "
                                   f"runs {', '.join(supported_model_types())}")
        arch = HF_MODEL_TYPES[model_type]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        # transformers >= 5 writes one "rope_parameters" dict; older configs have rope_theta + rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_check_rope_scaling(scaling),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int, tied: bool,
                  rope_factors: dict[str, list[float]] | None = None) -> ModelConfig:
        """Build from GGUF key/value metadata (``{arch}.block_count`` and friends); ``rope_factors``: the file's
        ``rope_factors_long``/``rope_factors_short`` tensors (Phi-3's longrope), by ``long``/``short``."""
        arch = meta["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported; fleetllm runs "
                                   f"{', '.join(GGUF_ARCHITECTURES)}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        head_dim = get("attention.key_length") or hidden // heads
        eos = meta.get("tokenizer.ggml.eos_token_id")
        mixtral = arch == "llama" and bool(get("expert_count"))
        base = cls(
            architecture="mixtral" if mixtral else GGUF_MODEL_TYPES.get(arch, arch),
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_check_rope_scaling(_rope_scaling_from_gguf(get, arch)),
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings=tied,
            attention_bias=arch in ("qwen2", "qwen2moe"),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=([eos] if eos is not None else []) + _end_of_turn(meta, arch),
        )
        if arch in GGUF_MOE or mixtral:
            base = replace(base, **_moe_from_gguf(get, arch))
        family = _GGUF_FAMILIES.get(arch)
        return replace(base, **family(get, base, rope_factors or {})) if family else base


GGUF_MOE = ("qwen2moe", "qwen3moe", "gpt-oss")  # besides Mixtral (llama with experts)


def _rope_scaling_from_gguf(get: Any, arch: str) -> dict[str, Any] | None:
    """``rope.scaling.*`` as HF's rope_scaling. YaRN's ramp: cut to whole dimensions as llama.cpp and HF do, but for
    GPT-OSS, whose HF config (and OpenAI's reference) keeps it fractional."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in GGUF_ROPE_SCALINGS:
        raise UnsupportedModel(f"GGUF RoPE scaling {kind!r} is not supported (supported: {', '.join(GGUF_ROPE_SCALINGS)})")
    scaling = {"rope_type": kind, "factor": get("rope.scaling.factor", 1.0)}
    if kind == "yarn":
        for key in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"):
            if get(f"rope.scaling.{key}") is not None:
                raise UnsupportedModel(f"GGUF RoPE scaling yarn with {key} is not supported")
        scaling.update(original_max_position_embeddings=get("rope.scaling.original_context_length"),
                       beta_fast=get("rope.scaling.yarn_beta_fast", 32.0), beta_slow=get("rope.scaling.yarn_beta_slow", 1.0),
                       truncate=arch != "gpt-oss")
    return scaling


def _moe_from_gguf(get: Any, arch: str) -> dict[str, Any]:
    """The experts of a GGUF mixture-of-experts model. llama.cpp renormalises the chosen experts' weights for
    Qwen3-MoE and Mixtral (``llama`` with experts) and not for Qwen2-MoE (the GGUF has no key for it), so the same
    here. Mixtral's experts are as wide as its ``feed_forward_length``."""
    width = get("expert_feed_forward_length") or get("feed_forward_length")
    return dict(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                moe_intermediate_size=width, norm_topk_prob=arch != "qwen2moe",
                shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0) or 0)


def _alternating(layers: int) -> list[str]:
    """Even layers slide, odd ones see everything (Gemma 2, GPT-OSS: llama.cpp's sliding-window pattern 2)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _gemma2_from_gguf(get: Any, base: ModelConfig, rope_factors: dict[str, list[float]]) -> dict[str, Any]:
    """Gemma 2: Gemma 3's layout without q/k norms, soft-capped attention scores and logits, one RoPE base. Its
    queries scale by ``head_dim`` but for the 27B (46 layers: hidden / heads), as llama.cpp hard-codes."""
    layers = base.num_layers
    return dict(hidden_act="gelu_tanh", rope_local_theta=base.rope_theta, sliding_window=get("attention.sliding_window"),
                layer_types=_alternating(layers), attn_logit_softcapping=get("attn_logit_softcapping"),
                final_logit_softcapping=get("final_logit_softcapping"),
                query_pre_attn_scalar=float(base.hidden_size // base.num_heads if layers == 46 else base.head_dim))


def _gemma3_fields(get: Any, base: ModelConfig, rope_factors: dict[str, list[float]]) -> dict[str, Any]:
    return _gemma3_from_gguf(get, base.hidden_size, base.num_heads, base.head_dim)


def _phi3_from_gguf(get: Any, base: ModelConfig, rope_factors: dict[str, list[float]]) -> dict[str, Any]:
    """Phi-3: a rotary share of each head (``rope.dimension_count``), a sliding window on every layer when the file
    names one (0: none, Phi-4), longrope from the factor tensors and the original context length."""
    out: dict[str, Any] = dict(partial_rotary_factor=get("rope.dimension_count", base.head_dim) / base.head_dim)
    window = get("attention.sliding_window") or 0
    if window:
        out.update(sliding_window=window, layer_types=["sliding_attention"] * base.num_layers)
    if rope_factors:
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": rope_factors["long"],
                               "short_factor": rope_factors["short"],
                               "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                               "attention_factor": get("rope.scaling.attn_factor")}
    return out


def _gpt_oss_from_gguf(get: Any, base: ModelConfig, rope_factors: dict[str, list[float]]) -> dict[str, Any]:
    """GPT-OSS: biases everywhere, attention sinks, even layers sliding, the top k experts' softmax and its clamped
    SwiGLU, whose limit and alpha the converter does not write (llama.cpp hard-codes both, as here)."""
    return dict(attention_bias=True, o_bias=True, attention_sinks=True, router="topk_softmax", router_bias=True,
                expert_bias=True, norm_topk_prob=False, swiglu_limit=7.0, swiglu_alpha=1.702,
                sliding_window=get("attention.sliding_window"), layer_types=_alternating(base.num_layers))


_GGUF_FAMILIES = {"gemma2": _gemma2_from_gguf, "gemma3": _gemma3_fields, "phi3": _phi3_from_gguf,
                  "gpt-oss": _gpt_oss_from_gguf}


def _end_of_turn(meta: dict[str, Any], arch: str) -> list[int]:
    """Gemma ends a chat turn with ``<end_of_turn>``, not EOS: stop there too (as llama.cpp does)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return [tokens.index("<end_of_turn>")] if arch in ("gemma2", "gemma3") and "<end_of_turn>" in tokens else []


def gemma3_layer_types(num_layers: int, pattern: int | list[bool]) -> list[str]:
    """Gemma 3 interleaves sliding and global layers: every ``pattern``-th layer is global (or one flag per layer)."""
    if isinstance(pattern, list):
        return ["sliding_attention" if s else "full_attention" for s in pattern]
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def _gemma3_from_gguf(get: Any, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3 fields from GGUF metadata; what llama.cpp's converter does not write, llama.cpp hard-codes too."""
    layers = get("block_count")
    return dict(
        hidden_act="gelu_tanh",
        # llama.cpp scales queries by head_dim, except for the 27B (62 layers) whose scalar is hidden / heads.
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        sliding_window=get("attention.sliding_window"),
        layer_types=gemma3_layer_types(layers, get("attention.sliding_window_pattern", 6)),
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
        final_logit_softcapping=get("final_logit_softcapping"),
    )


def _gemma3_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A HF ``Gemma3TextConfig``: RoPE per layer type (transformers >= 5) or rope_theta + rope_local_base_freq."""
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = cfg.get("rope_scaling")
    if scaling is None and full.get("rope_type", "default") != "default":
        scaling = full
    layers = cfg["num_hidden_layers"]
    eos = cfg.get("eos_token_id", 1)
    return ModelConfig(
        architecture="gemma3",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim", 256),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta") or cfg.get("rope_theta", 1_000_000.0)),
        rope_scaling=_check_rope_scaling(scaling),
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        attention_bias=cfg.get("attention_bias", False),
        qk_norm=True,
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=eos if isinstance(eos, list) else [eos],
        hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        sliding_window=cfg.get("sliding_window", 4096),
        layer_types=cfg.get("layer_types") or gemma3_layer_types(layers, cfg.get("sliding_window_pattern", 6)),
        rope_local_theta=float(local.get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )
