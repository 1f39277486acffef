"""Rotary position tables for every RoPE scaling fleetllm runs: default, linear, llama3 (Llama 3.1), yarn
(GPT-OSS) and longrope (Phi-3), each as HF transformers computes it.

The tables are per position, so what HF decides per forward pass from the sequence's length is decided here
per position instead: longrope takes its ``long_factor`` for positions past ``original_max_position_embeddings``
(HF switches when the sequence grows past it, which for a decode step is the same position).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fleetllm.models.config import ModelConfig

def scaling_kind(cfg: ModelConfig) -> str:
    sc = cfg.rope_scaling or {}
    return sc.get("rope_type") or sc.get("type") or "default"


def rotary_dim(cfg: ModelConfig) -> int:
    """How many of a head's dimensions rotate (Phi-3's ``partial_rotary_factor`` leaves the rest as they are)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies with the config's scaling (``long``: longrope's long factors)."""
    dim = rotary_dim(cfg)
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv = 1.0 / (cfg.rope_theta**exps)
    sc, kind = cfg.rope_scaling or {}, scaling_kind(cfg)
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, sc)
    elif kind == "yarn":
        inv = _yarn(cfg, sc, dim)
    elif kind == "longrope":
        factors = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv = 1.0 / (factors * cfg.rope_theta**shape)
    return inv.float()


def attention_factor(cfg: ModelConfig) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the others)."""
    sc, kind = cfg.rope_scaling or {}, scaling_kind(cfg)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    orig = sc["original_max_position_embeddings"]
    factor = sc.get("factor") or cfg.max_position_embeddings / orig
    if factor <= 1:
        return 1.0
    if kind == "yarn":
        mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")
        if mscale and mscale_all:
            return _mscale(factor, mscale) / _mscale(factor, mscale_all)
        return _mscale(factor)
    return math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each ``[max_position_embeddings, rotary_dim]`` fp32, in HF's "rotate half" layout."""
    t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))
    if scaling_kind(cfg) == "longrope":
        orig = cfg.rope_scaling["original_max_position_embeddings"]
        freqs[orig:] = torch.outer(t[orig:], rope_inv_freq(cfg, long=True))
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = attention_factor(cfg)
    return emb.cos() * scale, emb.sin() * scale


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_ctx = sc.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    mid = (wavelen <= low_wl) & (wavelen >= high_wl)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def _yarn(cfg: ModelConfig, sc: dict, dim: int) -> torch.Tensor:
    """YaRN: interpolated frequencies for the long wavelengths, extrapolated ones for the short, a ramp between."""
    base, orig = cfg.rope_theta, sc["original_max_position_embeddings"]
    factor = sc.get("factor") or cfg.max_position_embeddings / orig
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
