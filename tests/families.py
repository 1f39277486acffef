"""Tiny, seeded, random-initialised HF transformers models of each family fleetllm runs, built once per session.

Each is saved as safetensors with the embedded SmolLM2 tokenizer (the loader needs one; prompts are token ids
below the tiny vocabulary). ``initializer_range`` 0.2 keeps the greedy choice's margin well above float rounding.
Sliding windows are 12 positions, shorter than the longer prompts, so windows cut both prefill and decode.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
WINDOW = 12


def _configs(t: Any) -> dict[str, Callable[[], Any]]:
    moe = dict(num_experts_per_tok=2)
    return {
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, **moe, num_experts=8, moe_intermediate_size=32,
                                              norm_topk_prob=True, head_dim=32),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, **moe, num_experts=8, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48),
        "mixtral": lambda: t.MixtralConfig(**COMMON, **moe, num_local_experts=4, sliding_window=None),
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=WINDOW),
        "phi3": lambda: t.Phi3Config(**COMMON, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 48,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
        "gemma2": lambda: t.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16),
        "gpt_oss": lambda: t.GptOssConfig(**{**COMMON, "intermediate_size": 32}, **moe, num_local_experts=4,
                                          head_dim=16, sliding_window=WINDOW),
    }


FAMILIES = ("gemma2", "gpt_oss", "mistral", "mixtral", "phi3", "qwen2_moe", "qwen3_moe")
MOE_FAMILIES = ("gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe")
# soft-capping and sinks are what HF's eager attention computes (its SDPA path drops them)
_EAGER = ("gemma2", "gpt_oss")


class FamilyModels:
    """``get(family)`` -> (directory, HF model), each built on first use and kept for the session."""

    def __init__(self, root: Path, tokenizer_json: str) -> None:
        self.root, self.tokenizer_json = root, tokenizer_json
        self._built: dict[str, tuple[Path, Any]] = {}

    def get(self, family: str) -> tuple[Path, Any]:
        if family not in self._built:
            self._built[family] = self._build(family)
        return self._built[family]

    def _build(self, family: str) -> tuple[Path, Any]:
        import transformers

        torch.manual_seed(0)
        cfg = _configs(transformers)[family]()
        impl = "eager" if family in _EAGER else "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=impl)
        target = self.root / family
        model.eval().save_pretrained(target)
        (target / "tokenizer.json").write_text(self.tokenizer_json)
        return target, model

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@torch.no_grad()
def hf_greedy_logprobs(model: Any, prompt: list[int], out: list[int]) -> torch.Tensor:
    """HF's log-probabilities ``[len(out), vocab]`` at each output position, computed as its ``generate`` does: the
    prompt in one pass, then one token at a time over its KV cache (what Phi-3's longrope chooses depends on it)."""
    res = model(torch.tensor([prompt]), use_cache=True)
    rows, past = [res.logits[0, -1]], res.past_key_values
    with warnings.catch_warnings():  # transformers 5.25 renames past_key_values for some families only
        warnings.simplefilter("ignore", FutureWarning)
        for tok in out[:-1]:
            res = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            rows.append(res.logits[0, -1])
            past = res.past_key_values
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)
