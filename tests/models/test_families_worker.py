"""A dense and a mixture-of-experts family served by a worker answer HF transformers' greedy tokens, compared
as ids (``return_token_ids``), the prompts sent as token ids together so the worker batches them."""

from __future__ import annotations

import httpx
import pytest
from families import hf_greedy_logprobs

from fleetllm.models.loader import load_model

PROMPTS = [[5, 17, 99, 3, 42, 42, 7], list(range(10, 130, 3)), [200, 201]]
NEW = 32


@pytest.mark.parametrize("family", ["mistral", "qwen3_moe"])
def test_a_worker_serves_the_family_token_for_token(family: str, family_models, model_worker) -> None:
    path, hf = family_models.get(family)
    w = model_worker(load_model(str(path)), "--model", str(path), "--quantization", "none",
                     "--max-num-batched-tokens", "16")
    body = {"model": str(path), "prompt": PROMPTS, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(w.openai_base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for prompt, c in zip(PROMPTS, choices, strict=True):
        assert c["prompt_token_ids"] == prompt
        assert hf_greedy_logprobs(hf, prompt, c["token_ids"]).argmax(-1).tolist() == c["token_ids"]
        assert len(c["token_ids"]) == NEW
