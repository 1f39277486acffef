"""One decoder layer's weights under each family's HF checkpoint names, into :class:`~fleetllm.models.llama.DecoderLayer`.

Attention: ``q_proj``/``k_proj``/``v_proj`` (fused here), or Phi-3's ``qkv_proj``; biases (Qwen2, GPT-OSS), an
output bias and sinks (GPT-OSS), q/k norms (Qwen3). Dense MLP: ``gate_proj``/``up_proj`` (fused here) or Phi-3's
``gate_up_proj``. Experts, stacked into ``[E, 2I, H]`` and ``[E, H, I]``:

- Qwen2-MoE / Qwen3-MoE: ``mlp.gate`` (router), ``mlp.experts.{e}.{gate,up,down}_proj``; Qwen2-MoE's
  ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``;
- Mixtral: ``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down);
- GGUF (``qwen2moe``, ``qwen3moe``, Mixtral): ``mlp.experts.gate_up_proj`` and ``down_proj`` stacked already (the
  loader's cache of ``ffn_{gate,up,down}_exps``, gate and up fused there): views of the map, no copy;
- GPT-OSS: ``mlp.router`` (with bias), ``mlp.experts.gate_up_proj [E, H, 2I]`` with gate and up interleaved
  column by column (and its bias), ``mlp.experts.down_proj [E, I, H]`` (and bias): transposed and split here;
  from GGUF (``gpt-oss``), stacked as the others' with ``mlp.experts.{gate,up,down}_proj_bias``.

Stacking a safetensors checkpoint's experts copies them once at load (it keeps one tensor per expert).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fleetllm.models.config import ModelConfig
from fleetllm.models.llama import fuse, set_weight
from fleetllm.models.moe import MoE
from fleetllm.models.q8_weights import PackedQ8Linear, pop_packed

Take = Callable[[str], torch.Tensor]


def load_layer(layer: nn.Module, cfg: ModelConfig, p: str, take: Take, sd: dict[str, torch.Tensor]) -> None:
    """Weights of the layer under prefix ``p`` (``model.layers.{i}.``), taken out of ``sd`` by ``take``."""
    load_attention(layer.attn, cfg, p + "self_attn.", take, sd)
    set_weight(layer.input_norm, take(p + "input_layernorm.weight"))
    set_weight(layer.post_attn_norm, take(p + "post_attention_layernorm.weight"))
    if isinstance(layer.mlp, MoE):
        load_moe(layer.mlp, cfg, p, take, sd)
    else:
        load_mlp(layer.mlp, p + "mlp.", take, sd)


def load_attention(a: nn.Module, cfg: ModelConfig, p: str, take: Take, sd: dict[str, torch.Tensor]) -> None:
    """Attention weights; projections a Q8_0 GGUF's cache kept quantised become :class:`PackedQ8Linear` modules."""
    qkv_bias = fuse([take(p + f"{n}_proj.bias") for n in "qkv"]) if cfg.attention_bias else None
    o_bias = take(p + "o_proj.bias") if cfg.o_bias else None
    packed = pop_packed(sd, [p + f"{n}_proj.weight" for n in "qkv"])
    if packed is not None:
        a.qkv = PackedQ8Linear(*packed, qkv_bias)
    elif p + "qkv_proj.weight" in sd:
        set_weight(a.qkv, take(p + "qkv_proj.weight"))
    else:
        set_weight(a.qkv, fuse([take(p + f"{n}_proj.weight") for n in "qkv"]))
    if qkv_bias is not None and packed is None:
        set_weight(a.qkv, qkv_bias, "bias")
    packed = pop_packed(sd, [p + "o_proj.weight"])
    if packed is not None:
        a.o = PackedQ8Linear(*packed, o_bias)
    else:
        set_weight(a.o, take(p + "o_proj.weight"))
        if o_bias is not None:
            set_weight(a.o, o_bias, "bias")
    if cfg.attention_sinks:
        set_weight(a, take(p + "sinks"), "sinks")
    if cfg.qk_norm:
        set_weight(a.q_norm, take(p + "q_norm.weight"))
        set_weight(a.k_norm, take(p + "k_norm.weight"))


def load_mlp(mlp: nn.Module, p: str, take: Take, sd: dict[str, torch.Tensor]) -> None:
    """A dense gated MLP: ``gate_up_proj`` as it is, or ``gate_proj`` + ``up_proj`` fused."""
    if p + "gate_up_proj.weight" in sd:
        set_weight(mlp.gate_up, take(p + "gate_up_proj.weight"))
    else:
        set_weight(mlp.gate_up, fuse([take(p + "gate_proj.weight"), take(p + "up_proj.weight")]))
    set_weight(mlp.down, take(p + "down_proj.weight"))


def load_moe(moe: MoE, cfg: ModelConfig, p: str, take: Take, sd: dict[str, torch.Tensor]) -> None:
    if cfg.architecture == "gpt_oss":
        _load_gpt_oss_experts(moe, p + "mlp.", take, sd)
        return
    mixtral = p + "block_sparse_moe.gate.weight" in sd
    q = p + ("block_sparse_moe." if mixtral else "mlp.")
    set_weight(moe.router, take(q + "gate.weight"))
    if _quantised_experts(sd, q):  # a GGUF's quantised *_exps, kept so in the cache
        moe.set_quantised_experts(*(_pop_parts(sd, f"{q}experts.{w}_proj") for w in ("gate_up", "down")))
        _load_shared(moe, q, take, sd)
        return
    if q + "experts.gate_up_proj" in sd or q + "experts.gate_proj" in sd:  # stacked (a GGUF's *_exps, cached)
        fused = sd.get(q + "experts.gate_up_proj")
        gate_up = take(q + "experts.gate_up_proj") if fused is not None else torch.cat(
            [take(q + "experts.gate_proj"), take(q + "experts.up_proj")], dim=1)  # a cache entry from before fusing
        set_weight(moe, gate_up, "gate_up")
        set_weight(moe, take(q + "experts.down_proj"), "down")
        _load_shared(moe, q, take, sd)
        return
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    experts = range(cfg.num_experts)
    gate_up = [torch.cat([take(f"{q}experts.{e}.{names[0]}.weight"), take(f"{q}experts.{e}.{names[1]}.weight")])
               for e in experts]
    set_weight(moe, torch.stack(gate_up), "gate_up")
    set_weight(moe, torch.stack([take(f"{q}experts.{e}.{names[2]}.weight") for e in experts]), "down")
    _load_shared(moe, q, take, sd)


def _quantised_experts(sd: dict[str, torch.Tensor], q: str) -> bool:
    return q + "experts.gate_up_proj.q8" in sd or q + "experts.gate_up_proj.q4" in sd


def _pop_parts(sd: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, ...]:
    """A quantised expert weight's parts (models/expert_quant.py), popped as they are (``take`` would make the
    levels fp32): Q4's levels, factors and scales, or Q8_0's levels and scales."""
    parts = (".q4", ".q4_factors", ".q4_scale") if name + ".q4" in sd else (".q8", ".q8_scale")
    return tuple(sd.pop(name + p) for p in parts)


def _load_shared(moe: MoE, q: str, take: Take, sd: dict[str, torch.Tensor]) -> None:
    if moe.shared is not None:
        load_mlp(moe.shared, q + "shared_expert.", take, sd)
        gate = take(q + "shared_expert_gate.weight")
        set_weight(moe.shared_gate, gate.view(1, -1))  # GGUF stores it as a vector


def _load_gpt_oss_experts(moe: MoE, q: str, take: Take, sd: dict[str, torch.Tensor]) -> None:
    set_weight(moe.router, take(q + "router.weight"))
    set_weight(moe.router, take(q + "router.bias"), "bias")
    if q + "experts.gate_proj_bias" in sd:  # a GGUF's: stacked as the model multiplies, gate and up fused at load
        if _quantised_experts(sd, q):
            moe.set_quantised_experts(*(_pop_parts(sd, f"{q}experts.{w}_proj") for w in ("gate_up", "down")))
        else:
            set_weight(moe, take(q + "experts.gate_up_proj"), "gate_up")
            set_weight(moe, take(q + "experts.down_proj"), "down")
        bias = torch.cat([take(q + "experts.gate_proj_bias"), take(q + "experts.up_proj_bias")], dim=-1)
        set_weight(moe, bias, "gate_up_bias")
        set_weight(moe, take(q + "experts.down_proj_bias"), "down_bias")
        return
    w = take(q + "experts.gate_up_proj")  # [E, H, 2I]: column 2j is gate j, 2j + 1 is up j
    set_weight(moe, torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).transpose(1, 2).contiguous(), "gate_up")
    b = take(q + "experts.gate_up_proj_bias")
    set_weight(moe, torch.cat([b[..., 0::2], b[..., 1::2]], dim=-1).contiguous(), "gate_up_bias")
    set_weight(moe, take(q + "experts.down_proj").transpose(1, 2).contiguous(), "down")
    set_weight(moe, take(q + "experts.down_proj_bias"), "down_bias")
