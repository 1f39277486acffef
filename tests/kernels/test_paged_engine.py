"""The engine generates the same greedy tokens with the paged-attention kernel as with the eager path."""

from __future__ import annotations

from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm import LLM, SamplingParams
from fleetllm.kernels import attention
from fleetllm.models import llama

PROMPTS = ["def fibonacci(n):", "Once upon a time, in a land far away, there lived"]


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    res = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return [r.outputs[0].token_ids for r in res]


def test_kernel_and_eager_generate_the_same_tokens(loaded_model, monkeypatch) -> None:
    require_kernels(attention.LIBRARY)
    prompts = [loaded_model.tokenizer.encode(p) for p in PROMPTS]
    prompts.append(prompts[1] + prompts[0])  # a prefix-cache hit: its chunk attends to cached blocks
    calls = []
    monkeypatch.setattr(llama, "paged_attention", lambda *a, **kw: calls.append("table_of" in kw)
                        or attention.paged_attention(*a, **kw))
    # chunks of at most 3 tokens: every prompt past its first chunk is prefilled over cached context, in place
    # exact fp32: under q4 the decode stack (tests/kernels/test_decode_stack.py) takes these steps whole
    llm = LLM(loaded=loaded_model, num_blocks=64, max_num_batched_tokens=3, quantization="none")
    calls.clear()  # the start-up step-cost measure (speculation is on by default) ran steps through the kernel
    attention.set_kernel_enabled(False)
    try:
        eager = greedy(llm, prompts)
    finally:
        attention.set_kernel_enabled(True)
    assert not calls
    assert greedy(llm, prompts) == eager
    assert False in calls and True in calls, "decode steps and chunks over cached context both through the kernel"
