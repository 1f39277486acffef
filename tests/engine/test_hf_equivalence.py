"""Greedy outputs equal HF transformers' on the same dequantised GGUF weights (fp32), token for token.

The reference is checked by teacher forcing: one HF forward over prompt + our output must predict,
at every position, exactly the token we generated (which, by induction, is greedy equality), plus a
literal ``generate`` comparison on two prompts. Each scheduling regime must give the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from fleetllm import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # HF transformers' reference runs

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a child.",
    "def quicksort(arr):",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Why is the sky blue?",
    "Name a famous physicist and one discovery.",
    "SELECT name FROM users WHERE",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def loaded(loaded_model):
    return loaded_model  # the session's weights (tests/conftest.py)


@pytest.fixture(scope="module")
def hf_model():
    from hf_reference import hf_reference_dir

    # transformers' own conversion of the GGUF, saved once per machine (tests/hf_reference.py)
    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_reference_dir()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    tok = loaded.tokenizer
    ids = []
    for i, p in enumerate(PROMPTS):
        if i % 4 == 3:  # a quarter as raw completions, the rest through the chat template
            ids.append(tok.encode(p))
        else:
            ids.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False))
    return ids


def greedy(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    res = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [r.outputs[0].token_ids for r in res]


def assert_hf_agrees(hf_model, prompt_ids: list[list[int]], outputs: list[list[int]]) -> None:
    for p, out in zip(prompt_ids, outputs, strict=True):
        assert out, "no tokens generated"
        seq = torch.tensor([p + out])
        with torch.no_grad():
            logits = hf_model(seq).logits[0]
        predicted = logits[len(p) - 1 : len(p) - 1 + len(out)].argmax(-1).tolist()
        assert predicted == out, f"diverged from HF at token {next(i for i, (a, b) in enumerate(zip(predicted, out, strict=True)) if a != b)}"


@pytest.fixture(scope="module")
def reference(loaded, prompt_ids, hf_model):
    """All prompts batched together, each checked against HF: the outputs every other regime must give."""
    outs = greedy(LLM(loaded=loaded, max_num_seqs=16, kv_cache_gb=0.25), prompt_ids)
    assert_hf_agrees(hf_model, prompt_ids, outs)
    return outs


def test_concurrent_batch_matches_hf(reference):
    assert len(reference) == len(PROMPTS)


def test_one_at_a_time_matches(loaded, prompt_ids, reference):
    some = [0, 3, 7]
    assert greedy(LLM(loaded=loaded, max_num_seqs=1, kv_cache_gb=0.25), [prompt_ids[i] for i in some]) == [reference[i] for i in some]


def test_literal_hf_generate_matches(hf_model, prompt_ids, reference):
    for i in (0, 3):
        ids = torch.tensor([prompt_ids[i]])
        hf = hf_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
        expected = hf[0, len(prompt_ids[i]) :].tolist()
        assert reference[i] == expected[: len(reference[i])]


# The regimes below run on every other prompt (chat and raw, short and long): a step per 8 tokens of
# prefill and a pool of 8 blocks are slow ways to generate, and each half still crosses every boundary.
HALF = slice(0, None, 2)


def test_tiny_prefill_chunks_match(loaded, prompt_ids, reference):
    llm = LLM(loaded=loaded, max_num_seqs=16, max_num_batched_tokens=8, kv_cache_gb=0.25)
    assert greedy(llm, prompt_ids[HALF]) == reference[HALF]


def test_preemption_by_tiny_block_pool_matches(loaded, prompt_ids, reference):
    llm = LLM(loaded=loaded, max_num_seqs=16, num_blocks=8, block_size=8)
    assert greedy(llm, prompt_ids[1::2]) == reference[1::2]
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_prefix_cache_hit_matches(loaded, prompt_ids, reference):
    llm = LLM(loaded=loaded, max_num_seqs=16, kv_cache_gb=0.25)
    assert greedy(llm, prompt_ids[HALF]) == reference[HALF]
    res = llm.generate(prompt_ids[HALF], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [r.outputs[0].token_ids for r in res] == reference[HALF]
    assert all(r.num_cached_tokens > 0 for r, p in zip(res, prompt_ids[HALF], strict=True) if len(p) > 16)
