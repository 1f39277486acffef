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



def test_speculation_acceptance_is_counted_per_adapter_and_the_parts_sum_to_the_totals(loaded_model,
                                                                                       tmp_path) -> None:
    from fleet_helpers import smollm2_adapter

    llm = LLM(loaded=loaded_model, enable_lora=True, num_blocks=64, speculative="method=ngram,k=4,adaptive=0")
    llm.load_lora("a1", smollm2_adapter(tmp_path / "a1", seed=1))
    ids = loaded_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)  # copied on: drafts
    llm.generate([ids, ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), lora_name=["a1", None])
    m = llm.engine.metrics
    m.spec_sync(llm.engine.spec)  # what a scrape after the last step reads

    def value(what: str, lora: str | None = None) -> float:
        labels = {**m.labels, **({} if lora is None else {"lora_name": lora})}
        return m.registry.get_sample_value(f"{'vllm' if lora is None else 'fleetllm'}:spec_decode_{what}_total",
                                           labels) or 0.0

    whats = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    adapter, base = ([value(w, lora) for w in whats] for lora in ("a1", ""))  # "": the base model's series
    assert adapter[2] > 0 and base[2] > 0  # each request's drafts were accepted under its own label
    assert [a + b for a, b in zip(adapter, base, strict=True)] == [value(w) for w in whats]
