"""What a model weighs and computes: its shape, from HF ``config.json``, GGUF metadata or a small catalogue.

Only the numbers the performance model needs: parameters (all, and active per token for a
mixture-of-experts), bytes of KV cache per token, and the attention's size. A dense decoder's shape is
read through fleetllm's own :class:`fleetllm.models.config.ModelConfig` (the loader's reader), mixture-of-experts
families fleetllm runs included; other architectures are read from the usual config.json keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from fleetllm.errors import UsageError, did_you_mean
from fleetllm.models.config import ModelConfig, UnsupportedModel


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # dense MLP width (per expert: moe_intermediate)
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    moe_intermediate: int = 0
    tied: bool = False
    max_context: int = 131072
    runs_here: str | None = None  # the fleetllm model source that runs it on this machine, if any

    @cached_property
    def attention_params(self) -> int:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        return q_o + 2 * self.hidden * self.kv_heads * self.head_dim

    def _mlp_params(self, experts: int) -> int:
        if not self.experts:
            return 3 * self.hidden * self.intermediate
        return 3 * self.hidden * self.moe_intermediate * experts + self.hidden * self.experts  # + router

    @cached_property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @cached_property
    def params(self) -> int:
        """Every weight (what must fit in memory)."""
        return self.layers * (self.attention_params + self._mlp_params(self.experts or 1)) + self.embedding_params

    @cached_property
    def active_params(self) -> int:
        """Weights one token multiplies by (2 FLOPs each): the LM head, not the embedding lookup."""
        return self.layers * (self.attention_params + self._mlp_params(self.experts_per_token or 1)) + self.vocab * self.hidden

    def experts_touched(self, tokens: int) -> float:
        """Distinct experts per layer a step of ``tokens`` tokens is expected to read: each token picks
        ``experts_per_token`` of ``experts``, so an expert escapes all of them with probability (1 - k/E)^tokens
        (top-8 of 64: 8 at one token, ~42 at 8, all 64 at a few hundred)."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** max(tokens, 1))

    def params_read(self, tokens: int) -> float:
        """Weights one step of ``tokens`` tokens reads: every weight of a dense model; a mixture of experts' shared
        part (attention, router, embeddings) and the experts its tokens touch, each read once however many chose it."""
        if not self.experts:
            return float(self.params)
        untouched = self.experts - self.experts_touched(tokens)
        return self.params - self.layers * 3 * self.hidden * self.moe_intermediate * untouched

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def attention_flops(self, context: float) -> float:
        """FLOPs of one token's attention over ``context`` earlier tokens (QK^T and AV)."""
        return 4.0 * self.layers * self.heads * self.head_dim * context


CATALOGUE: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 49152, 1536, tied=True, max_context=8192,
                               runs_here="smollm2-135m"),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 128256, 14336),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 128256, 28672),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 151936, 6144, experts=128,
                                experts_per_token=8, moe_intermediate=768, max_context=40960),
}
ALIASES = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
           "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m", "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b"}


def from_model_config(name: str, cfg: ModelConfig, runs_here: str | None = None) -> ModelShape:
    """The shape of a model fleetllm can load (its experts: all of them count for memory, the chosen for compute)."""
    return ModelShape(name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.vocab_size, cfg.intermediate_size, experts=cfg.num_experts,
                      experts_per_token=cfg.num_experts_per_tok, moe_intermediate=cfg.moe_intermediate_size,
                      tied=cfg.tie_word_embeddings, max_context=cfg.max_position_embeddings, runs_here=runs_here)


def from_hf_config(name: str, d: dict[str, Any], runs_here: str | None = None) -> ModelShape:
    """The shape from a HF ``config.json`` dict: through fleetllm's reader when it runs the model, else the
    usual keys (``num_local_experts``/``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``)."""
    d = d.get("text_config") or d
    experts = int(d.get("num_local_experts") or d.get("num_experts") or d.get("n_routed_experts") or 0)
    try:
        return from_model_config(name, ModelConfig.from_hf(d), runs_here)
    except (UnsupportedModel, KeyError):
        pass
    heads = int(d["num_attention_heads"])
    return ModelShape(
        name, int(d["num_hidden_layers"]), int(d["hidden_size"]), heads, int(d.get("num_key_value_heads") or heads),
        int(d.get("head_dim") or d["hidden_size"] // heads), int(d["vocab_size"]), int(d.get("intermediate_size") or 0),
        experts=experts, experts_per_token=int(d.get("num_experts_per_tok") or 0),
        moe_intermediate=int(d.get("moe_intermediate_size") or d.get("intermediate_size") or 0),
        tied=bool(d.get("tie_word_embeddings", False)), max_context=int(d.get("max_position_embeddings") or 131072),
        runs_here=runs_here)


def from_gguf(path: Path) -> ModelShape:
    """The shape from a GGUF file's metadata (the loader's reader; no tensors are read)."""
    from fleetllm.models.gguf_file import read_gguf_file

    return from_model_config(path.stem, read_gguf_file(path).model_config(), runs_here=str(path))


def load_shape(ref: str) -> ModelShape:
    """A catalogue name or HF id, a ``config.json`` (or its directory), or a ``.gguf`` file."""
    key = ALIASES.get(ref, ref).lower()
    if key in CATALOGUE:
        return CATALOGUE[key]
    p = Path(ref)
    if p.is_dir() and (p / "config.json").exists():
        return from_hf_config(p.name, json.loads((p / "config.json").read_text()), runs_here=str(p))
    if p.is_file() and p.suffix == ".json":
        return from_hf_config(p.parent.name or p.stem, json.loads(p.read_text()))
    if p.is_file() and p.suffix == ".gguf":
        return from_gguf(p)
    raise UsageError(f"unknown model {ref!r}: give a config.json, a model directory, a .gguf file or one of "
                     f"{', '.join(CATALOGUE)}{did_you_mean(key, CATALOGUE)}")


def profiled_shape(model: str) -> ModelShape | None:
    """The shape of the model a timing profile measured (its ``model``: a catalogue name, a ``.gguf`` file or a
    model directory), or None when it cannot be read here (the profile is then used unscaled)."""
    try:
        return load_shape(model)
    except (UsageError, OSError, ValueError, KeyError):
        return None
