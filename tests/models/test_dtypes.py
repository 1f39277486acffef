"""The bf16 path (what CUDA runs) works end to end: weights, rotary tables and KV cache agree on dtype."""

from __future__ import annotations

import torch

from fleetllm import LLM, SamplingParams
from fleetllm.models.loader import LoadedModel, load_model


def test_bf16_model_generates_like_fp32_on_an_easy_prompt(loaded_model: LoadedModel) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    prompt = "The capital of France is"
    bf16 = LLM(loaded=load_model("smollm2-135m", dtype=torch.bfloat16), kv_cache_gb=0.25)
    assert bf16.engine.kv_blocks()[0][0].dtype == torch.bfloat16
    fp32 = LLM(loaded=loaded_model, kv_cache_gb=0.25)
    assert bf16.generate([prompt], params)[0].outputs[0].text.strip().startswith("Paris")
    assert fp32.generate([prompt], params)[0].outputs[0].text.strip().startswith("Paris")
