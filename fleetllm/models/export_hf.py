"""Write a model as a HF directory (fp32 safetensors, config.json, tokenizer files): a GGUF turned into the
layout the hub serves, e.g. to publish the embedded model to a hub or bucket, or to test and measure the store
with it. The weights are the loader's own fp32 tensors, so the directory loads back to the identical model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from fleetllm.models.config import ModelConfig
from fleetllm.models.tokenizer import TokenizerWrapper


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` that :meth:`ModelConfig.from_hf` reads back to ``cfg`` (Llama-family models)."""
    if cfg.architecture not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"exporting a {cfg.architecture} model as a HF directory is not supported")
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.architecture]
    return {
        "architectures": [arch], "model_type": cfg.architecture, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids,
        "torch_dtype": "float32",
    }


def export_hf_dir(ref: str, out: Path) -> Path:
    """Write model ``ref`` (an alias, .gguf file or HF directory) into ``out`` as a HF directory; return ``out``."""
    from safetensors.torch import save_file

    from fleetllm.models.loader import dequantised, quantised_experts, read_gguf, read_hf_dir
    from fleetllm.models.source import dequant_cache_dir, load_tokenizer, resolve

    path = resolve(ref)
    out.mkdir(parents=True, exist_ok=True)
    cached = dequant_cache_dir(path) / "model.safetensors" if path.is_file() else None
    if cached is not None and cached.exists() and not quantised_experts(cached):
        # the dequantised cache already is these tensors as fp32 safetensors: share it, don't rewrite 0.5 GB
        cfg, tok = load_tokenizer(str(path))
        (out / "model.safetensors").unlink(missing_ok=True)  # an earlier export into ``out``: replace it
        try:
            os.link(cached, out / "model.safetensors")
        except OSError:
            shutil.copyfile(cached, out / "model.safetensors")
    else:
        cfg, sd, tok = read_hf_dir(path) if path.is_dir() else read_gguf(path)
        save_file({k: v.contiguous() for k, v in dequantised(sd).items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    write_tokenizer(tok, out)
    return out


def write_tokenizer(tok: TokenizerWrapper, out: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (chat template, bos/eos) as TokenizerWrapper reads them."""
    (out / "tokenizer.json").write_text(tok.tok.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos}, indent=1))
