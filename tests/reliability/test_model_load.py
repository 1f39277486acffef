"""A model fleetllm cannot run fails at load with a message naming why, never loads as Llama."""

from __future__ import annotations

import pytest

from fleetllm.models.config import ModelConfig, UnsupportedModel

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _gguf(arch: str, **extra) -> dict:
    return {"general.architecture": arch, f"{arch}.attention.head_count": 4, f"{arch}.embedding_length": 32,
            f"{arch}.feed_forward_length": 64, f"{arch}.block_count": 2, **{f"{arch}.{k}": v for k, v in extra.items()}}


@pytest.mark.parametrize("cfg,named", [
    ({**LLAMA, "model_type": "mamba", "architectures": ["MambaForCausalLM"]}, "mamba"),
    ({k: v for k, v in LLAMA.items() if k != "model_type"}, "model_type"),
    ({**LLAMA, "rope_scaling": {"type": "su", "factor": 4.0}}, "su"),
    ({**LLAMA, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
])
def test_an_unsupported_hf_config_fails_naming_it(cfg: dict, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("meta,named", [
    (_gguf("mamba"), "mamba"),
    (_gguf("llama", **{"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}), "longrope"),
])
def test_an_unsupported_gguf_fails_naming_it(meta: dict, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        ModelConfig.from_gguf(meta, vocab_size=64, tied=True)


def test_supported_scalings_still_load() -> None:
    for scaling in (None, {"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0},
                    {"rope_type": "llama3", "factor": 8.0}, {"rope_type": "default"},
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}):
        assert ModelConfig.from_hf({**LLAMA, "rope_scaling": scaling}).architecture == "llama"
    assert ModelConfig.from_hf({**LLAMA, "model_type": "qwen2"}).architecture == "qwen2"


def test_mxfp4_gpt_oss_weights_fail_naming_them() -> None:
    cfg = {**LLAMA, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2,
           "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedModel, match="mxfp4"):
        ModelConfig.from_hf(cfg)


def test_a_family_with_another_activation_fails_naming_it() -> None:
    with pytest.raises(UnsupportedModel, match="gelu"):
        ModelConfig.from_hf({**LLAMA, "model_type": "mistral", "hidden_act": "gelu"})
