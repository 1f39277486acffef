"""Every family fleetllm runs beyond Llama/Qwen/Gemma 3 generates HF transformers' greedy tokens, in exact mode.

Through ``LLM`` with the prompts batched, long prompts chunked (16-token steps), sliding windows shorter than the
prompts, a KV pool too small for all of them at once (requests are preempted and recomputed), and a second request
continuing a first one's output from the prefix cache. Log-probabilities of every
chosen token within 1e-4 of HF's, computed as HF's ``generate`` does (tests/families.py).
"""

from __future__ import annotations

import pytest
from families import FAMILIES, hf_greedy_logprobs

from fleetllm import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 42, 7], list(range(10, 130, 3)), [200, 201], list(range(300, 325))]
NEW = 32


def assert_matches_hf(model, prompt: list[int], out: list[int], logprobs: list[float]) -> None:
    ref = hf_greedy_logprobs(model, prompt, out)
    assert ref.argmax(-1).tolist() == out
    chosen = ref[range(len(out)), out]
    assert max(abs(a - b) for a, b in zip(chosen.tolist(), logprobs, strict=True)) < 1e-4


def preemptions(llm: LLM) -> float:
    return sum(s.value for m in llm.engine.metrics.registry.collect() for s in m.samples
               if s.name == "vllm:num_preemptions_total")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_greedy_equals_transformers(family: str, family_models) -> None:
    path, hf = family_models.get(family)
    # 9 blocks of 16 tokens: the 4 requests need 15 by their ends
    llm = LLM(str(path), quantization="none", max_num_batched_tokens=16, num_blocks=9, block_size=16)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    results = llm.generate(PROMPTS, params)
    assert preemptions(llm) > 0
    for prompt, r in zip(PROMPTS, results, strict=True):
        c = r.outputs[0]
        assert len(c.token_ids) == NEW
        assert_matches_hf(hf, prompt, c.token_ids, [lp.logprob for lp in c.logprobs])
    # the long prompt and 8 of its tokens again: its blocks come from the prefix cache, the rest is the same greedy
    again = PROMPTS[1] + results[1].outputs[0].token_ids[:8]
    hit = llm.generate([again], SamplingParams(max_tokens=NEW - 8, temperature=0.0, ignore_eos=True))[0]
    assert hit.num_cached_tokens >= 32
    assert hit.outputs[0].token_ids == results[1].outputs[0].token_ids[8:]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_keeps_a_moe_models_greedy_output(method: str, family_models) -> None:
    """Verify steps (several rows per request through the router and experts) accept drafts and change nothing."""
    path, _ = family_models.get("qwen3_moe")
    prompts = [[7, 8, 9, 10] * 6, PROMPTS[1]]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    plain = [r.outputs[0].token_ids for r in LLM(str(path), quantization="none").generate(prompts, params)]
    # adaptive=0: always draft (adaptive K weighs measured step costs, which a busy machine can tip to "never")
    spec = LLM(str(path), quantization="none", speculative=f"method={method},k=3,adaptive=0")
    assert [r.outputs[0].token_ids for r in spec.generate(prompts, params)] == plain
    assert spec.engine.executor.spec.num_accepted > 0
