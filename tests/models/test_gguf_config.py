"""GGUF metadata read into a model config: YaRN's keys, and the ones fleetllm does not apply refused by name."""

from __future__ import annotations

import pytest

from fleetllm.models.config import ModelConfig, UnsupportedModel


def metadata(arch: str, **rope: float | str) -> dict:
    base = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
            "context_length": 512, **{f"rope.scaling.{k}": v for k, v in rope.items()}}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in base.items()}}


YARN = dict(type="yarn", factor=32.0, original_context_length=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0)


def test_yarn_is_read_with_its_context_and_betas() -> None:
    cfg = ModelConfig.from_gguf(metadata("qwen3", **YARN), 512, tied=True)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}


def test_gpt_oss_keeps_yarns_ramp_fractional_as_its_hf_config_does() -> None:
    cfg = ModelConfig.from_gguf(metadata("gpt-oss", **YARN), 512, tied=True)
    assert cfg.architecture == "gpt_oss" and cfg.rope_scaling["truncate"] is False
    assert cfg.layer_types == ["sliding_attention", "full_attention"]


def test_a_yarn_attention_factor_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModel, match="yarn_attn_factor"):
        ModelConfig.from_gguf(metadata("qwen3", **YARN, yarn_attn_factor=0.5), 512, tied=True)
