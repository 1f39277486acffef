"""The quality checks of benchmarks/fast_path_quality.py, small: the exact path passes them against itself."""

from __future__ import annotations

from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm.bench.quality import REFERENCE_PROMPTS, compare, prompt_ids, stdlib_text
from fleetllm.models.quant import BF16_ROWS


def test_exact_path_agrees_with_itself_in_every_batch_regime(loaded_model) -> None:
    tok = loaded_model.tokenizer
    prompts = prompt_ids(tok, REFERENCE_PROMPTS[:1] + REFERENCE_PROMPTS[-1:], raw_from=1)
    q = compare(loaded_model, {"quantization": "none"}, prompts, tokens=4, text=stdlib_text(tok, 120), window=60,
                chunk=25)  # chunks over cached context against whole windows
    assert (q.agree_batched, q.agree_one_by_one) == (2, 2)
    assert abs(q.ppl_ratio - 1) < 1e-4, (q.ppl, q.ppl_fp32)


def test_q4_narrow_steps_agree_with_fp32(loaded_model) -> None:
    from fleetllm.kernels import q4, q4_int

    require_kernels(q4.LIBRARY, q4_int.LIBRARY)
    tok = loaded_model.tokenizer
    prompts = prompt_ids(tok, REFERENCE_PROMPTS[:1] + REFERENCE_PROMPTS[-1:], raw_from=1)
    q = compare(loaded_model, {"quantization": "q4"}, prompts, tokens=8, text=stdlib_text(tok, 120), window=60,
                chunk=BF16_ROWS - 1)  # every scored step narrow, through the Q4 kernel
    assert q.agree_one_by_one == 2
    assert abs(q.ppl_ratio - 1) < 1e-3, (q.ppl, q.ppl_fp32)


def test_q4_wide_steps_in_bf16_stay_within_the_goal(loaded_model) -> None:
    from fleetllm.kernels import bf16

    require_kernels(bf16.LIBRARY)
    tok = loaded_model.tokenizer
    prompts = prompt_ids(tok, REFERENCE_PROMPTS[:1] + REFERENCE_PROMPTS[-1:], raw_from=1)
    q = compare(loaded_model, {"quantization": "q4"}, prompts, tokens=8, text=stdlib_text(tok, 120), window=60,
                chunk=16)  # every scored step wide, through the bf16 kernel
    assert q.agree_batched == 2
    assert abs(q.ppl_ratio - 1) < 1e-2, (q.ppl, q.ppl_fp32)  # issue #19's bound
