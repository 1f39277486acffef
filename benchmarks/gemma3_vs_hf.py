"""The real Gemma-3-270M against HF transformers on the same GGUF: tokens and greedy outputs, token for token.

HF loads the GGUF itself (its own dequantisation and tokenizer, over a minute on 2 cores), so the weights'
mapping, the norms' +1, the embedding scale and the tokenizer are checked against an independent reading.
Greedy equality is checked by teacher forcing: one HF forward over prompt + fleetllm's output must predict,
at every position, the token fleetllm generated. The test suite keeps the tiny Gemma 3 against HF and the
real one's regimes against its own batched output (tests/models/test_gemma3.py); this is the heavy peer.

    python benchmarks/gemma3_vs_hf.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from gemma3_prompts import CAPS, PROMPTS_WITH_LONG, TOKENIZER_TEXTS  # noqa: E402

from fleetllm import LLM, SamplingParams  # noqa: E402
from fleetllm.models.loader import load_model, resolve  # noqa: E402


def first_divergence(hf_model, prompt: list[int], out: list[int]) -> int | None:
    """The first position where HF's greedy choice differs from ``out`` (None: equal throughout)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out]), logits_to_keep=len(out) + 1).logits[0]
    predicted = logits[:-1].argmax(-1).tolist()
    return next((j for j, (a, b) in enumerate(zip(predicted, out, strict=True)) if a != b), None)


def main() -> int:
    t0 = time.perf_counter()
    path = Path(resolve("gemma3-270m"))
    ours = load_model("gemma3-270m")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    print(f"loaded fleetllm's and HF's Gemma-3-270M in {time.perf_counter() - t0:.0f}s")
    failures = 0
    for text in TOKENIZER_TEXTS:
        ids = ours.tokenizer.encode(text)
        same = ids == hf_tok(text).input_ids and ours.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        failures += not same
        print(f"tokenizer {'ok  ' if same else 'DIFF'} {text[:40]!r}")
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS_WITH_LONG]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in CAPS]
    outs = [r.outputs[0].token_ids for r in LLM(loaded=ours).generate(prompts, params)]
    for text, p, out in zip(PROMPTS_WITH_LONG, prompts, outs, strict=True):
        at = first_divergence(hf, p, out)
        failures += at is not None
        print(f"greedy    {'ok  ' if at is None else f'DIFF at token {at}'} ({len(p)} prompt tokens) {text[:40]!r}")
    print(f"{len(TOKENIZER_TEXTS) + len(prompts) - failures} of {len(TOKENIZER_TEXTS) + len(prompts)} equal to HF")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
