"""The quality checks of benchmarks/fast_path_quality.py, small: the exact path passes them against itself."""

from __future__ import annotations

from fleetllm.bench.quality import REFERENCE_PROMPTS, compare, prompt_ids, stdlib_text


def test_exact_path_agrees_with_itself_in_every_batch_regime(loaded_model) -> None:
    tok = loaded_model.tokenizer
    prompts = prompt_ids(tok, REFERENCE_PROMPTS[:1] + REFERENCE_PROMPTS[-1:], raw_from=1)
    q = compare(loaded_model, {"quantization": "none"}, prompts, tokens=6, text=stdlib_text(tok, 300), window=150,
                chunk=50)  # chunks over cached context against whole windows
    assert (q.agree_batched, q.agree_one_by_one) == (2, 2)
    assert abs(q.ppl_ratio - 1) < 1e-4, (q.ppl, q.ppl_fp32)
