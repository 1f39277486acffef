"""Greedy outputs with speculation are token-identical to greedy outputs without it.

9 prompts (chat, code, long-context copy) on the embedded model, batched, through an engine tight
enough that prefills are chunked and sequences are preempted, run twice so the second pass starts from
prefix-cache hits. Every method, fixed K (adaptive off) so drafts are verified on every step they exist.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.kernels import bf16
from fleetllm.models.loader import LoadedModel
from fleetllm.models.quant import BF16_ROWS
from fleetllm.speculative.eagle import head_path
from fleetllm.speculative.step_cost import StepCost

CHAT = [
    "What is the capital of France?", "Explain photosynthesis to a child.", "Give me a haiku about the sea.",
    "Why is the sky blue?", "Name three prime numbers greater than 50.", "What does HTTP stand for?",
    "Write a short email declining a meeting.", "Summarise Romeo and Juliet in one sentence.",
    "How do vaccines work?", "What is the difference between weather and climate?",
    "Suggest a name for a bakery.", "Count from one to ten in French.",
]
CODE = [
    "Write a Python function that reverses a linked list.", "def quicksort(arr):",
    "Write a SQL query that counts orders per customer.", "Explain what a Python decorator is, with code.",
    "class Stack:\n    def __init__(self):", "Write a bash one-liner that counts lines in all .py files.",
    "Implement binary search in Python.", "import json\n\ndef load_config(path):",
    "Write a JavaScript function that debounces another function.", "What does `git rebase -i` do?",
]
DOC = ("The deployment failed at step 3 with error E1042: the volume /data/cache was mounted read-only. "
       "Retry policy: 3 attempts, exponential backoff starting at 2 seconds. Owner: platform-team. ")
COPY = [
    f"Tool output:\n{DOC * 2}\nRepeat the tool output exactly.",
    f"Here is a log line: {DOC}\nQuote the error code and the path it mentions.",
    "Copy this list exactly: apples, pears, plums, cherries, apricots, figs, dates, grapes, lemons, limes.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# Now write mul and div the same way:\n",
    f"Repeat after me three times: {DOC}",
    "Rewrite with the variable renamed to total:\nx = 0\nfor i in range(10):\n    x += i\nprint(x)\n",
    "The password policy says: at least 12 characters, one digit, one symbol. Restate the policy word for word.",
    "JSON: {\"id\": 17, \"name\": \"widget\", \"tags\": [\"a\", \"b\"], \"price\": 9.5}. Print the same JSON back.",
    "Translate to uppercase: the quick brown fox jumps over the lazy dog",
    "Continue the sequence: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
]
# a sample of each kind, copy-heavy (where drafts are accepted): every regime below still happens (asserted)
PROMPTS = CHAT[::4] + CODE[::5] + COPY[::3]
MAX_TOKENS = 16
METHODS = ["ngram", "suffix", "eagle", "peagle"]


@pytest.fixture(scope="module")
def loaded(loaded_model: LoadedModel) -> LoadedModel:
    return loaded_model  # the session's weights (tests/conftest.py)


@pytest.fixture(scope="module")
def prompt_ids(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    ids = []
    for i, p in enumerate(PROMPTS):
        raw = i % 5 == 4  # a fifth as raw completions, the rest through the chat template
        ids.append(tok.encode(p) if raw else tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])))
    return ids


# An fp32 pool (whatever auto is on the fast path): a verify chunk or a recompute after preemption attends within the chunk
# over K/V as computed, where plain decoding reads them back rounded to a narrower pool's dtype; equality across
# these paths is a property of the scheduling and speculation, which an fp32 pool isolates.
POOL = {"kv_cache_dtype": "fp32"}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, prompt_ids: list[list[int]]) -> list[list[int]]:
    llm = LLM(loaded=loaded, num_blocks=512, **POOL)
    return [r.outputs[0].token_ids for r in llm.generate(prompt_ids, greedy())]


def tight_llm(loaded: LoadedModel, method: str) -> LLM:
    # 128-token budget: long prompts are chunked; 20 blocks of 16 cannot hold the sequences as they grow
    return LLM(loaded=loaded, num_blocks=20, max_num_batched_tokens=128, speculative=f"method={method},k=4,adaptive=0",
               **POOL)


def available(method: str) -> bool:
    return method not in ("eagle", "peagle") or head_path("smollm2-135m", method).exists()


# every method over every prompt, twice: the slow tier (the logprobs test below is the fast tier's check)
@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def spec_run(request, loaded: LoadedModel, prompt_ids: list[list[int]]) -> Iterator[tuple[LLM, list, list]]:
    method = request.param
    if not available(method):
        pytest.skip(f"no shipped {method} head")
    llm = tight_llm(loaded, method)
    first = [r.outputs[0].token_ids for r in llm.generate(prompt_ids, greedy())]
    second = [r.outputs[0].token_ids for r in llm.generate(prompt_ids[::4], greedy())]
    yield llm, first, second


def test_batched_greedy_with_speculation_equals_greedy_without(spec_run, reference) -> None:
    _, first, second = spec_run
    assert first == reference
    assert second == reference[::4]  # second pass: from prefix-cache hits


def test_the_run_exercised_drafts_chunking_preemption_and_prefix_hits(spec_run) -> None:
    llm, _, _ = spec_run
    eng = llm.engine
    assert eng.spec.num_accepted > 0
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.prefix_hits > 0


def test_no_block_leaks_after_speculation(spec_run) -> None:
    eng = spec_run[0].engine
    assert eng.pool.num_free == eng.pool.num_blocks
    eng.pool.check({})


@pytest.mark.slow
def test_one_request_at_a_time_equals_greedy_without(loaded: LoadedModel, prompt_ids, reference) -> None:
    llm = LLM(loaded=loaded, num_blocks=256, speculative="method=suffix,k=6,adaptive=0", **POOL)
    for ids, ref in list(zip(prompt_ids, reference, strict=True))[::6]:
        assert llm.generate([ids], greedy())[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("wide", ["bf16", "int16"])
def test_logprobs_of_verified_tokens_match_plain_decoding(loaded: LoadedModel, prompt_ids, wide: str) -> None:
    """A verification step (the last token and 6 drafts: 7 rows) takes the bf16 kernel where this CPU has one,
    plain decoding (1 row) the int16 one: the tokens and top lists agree, the logprobs to bf16's rounding; with
    the bf16 kernel off both take the int16 one and the logprobs agree to float rounding."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ids = prompt_ids[len(CHAT[::4]) + len(CODE[::5])]  # a copy prompt: drafts are accepted
    bf16.set_enabled(wide == "bf16")
    try:
        plain = LLM(loaded=loaded, num_blocks=64).generate([ids], params)[0].outputs[0].logprobs
        llm = LLM(loaded=loaded, num_blocks=64, speculative=f"method=ngram,k={BF16_ROWS - 1},adaptive=0")
        spec = llm.generate([ids], params)[0].outputs[0].logprobs
    finally:
        bf16.set_enabled(True)
    assert llm.engine.spec.num_accepted > 0
    assert [lp.token_id for lp in spec] == [lp.token_id for lp in plain]
    assert [[t for t, _ in lp.top] for lp in spec] == [[t for t, _ in lp.top] for lp in plain]
    # bf16: 0.014 measured (each activation rounded to 8 bits of mantissa instead of int16's 15)
    bound = 5e-2 if wide == "bf16" and bf16.kernel_ready() else 1e-3
    assert max(abs(a.logprob - b.logprob) for a, b in zip(spec, plain, strict=True)) < bound


def test_adaptive_k_over_a_batch_equals_greedy_without(loaded: LoadedModel, prompt_ids, reference) -> None:
    # adaptive K splits drafts over the batch, then again over what was drafted; a flat step cost (verifies
    # free) makes it draft whatever it can, whatever this machine's measured cost would decide
    llm = LLM(loaded=loaded, num_blocks=512, speculative="method=suffix", **POOL)
    llm.engine.spec.cost = StepCost([1, 1024], [1.0, 1.0])
    assert [r.outputs[0].token_ids for r in llm.generate(prompt_ids, greedy())] == reference
    assert llm.engine.spec.num_accepted > 0
