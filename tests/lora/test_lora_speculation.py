"""Speculative decoding stays lossless with adapters: n-gram drafts are verified by the adapted model."""

from __future__ import annotations

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling import SamplingParams

PROMPTS = [[1, 50, 51, 52, 53, 50, 51, 52, 53, 50, 51, 52], [1, 7, 8, 9, 7, 8, 9, 7, 8]]  # repeats: drafts found


def test_ngram_speculation_keeps_every_adapters_greedy_output(tiny_lora) -> None:
    names = [None, "qv4", "all8", "mixed16"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    jobs = [(p, n) for p in PROMPTS for n in names]
    outs = []
    for spec in (None, "method=ngram,k=3,adaptive=0"):
        llm = LLM(str(tiny_lora.base_dir), quantization="none", enable_lora=True, num_blocks=64, speculative=spec)
        for name, path in tiny_lora.dirs.items():
            llm.load_lora(name, str(path))
        res = llm.generate([p for p, _ in jobs], params, lora_name=[n for _, n in jobs])
        outs.append([r.outputs[0].token_ids for r in res])
        drafted = llm.engine.spec.num_draft_tokens if spec else None
    assert outs[0] == outs[1]
    assert drafted > 0, "no drafts: the comparison would not test verification"
