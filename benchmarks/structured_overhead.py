"""Decode speed with a JSON schema against unconstrained, at concurrency 1 and 16, on the engine itself.

Both runs produce the same number of tokens per request: the unconstrained one ignores EOS, the schema
(an array of at least ``--min-items`` records) cannot be complete before ``--max-tokens``. Reported per
concurrency: output tok/s of each (per wall second and per CPU second of the process) and their ratio
(constrained / unconstrained), best of ``--repeat``
interleaved rounds (the machine is shared: the best round is the least disturbed one).

    python benchmarks/structured_overhead.py [--max-tokens 48] [--repeat 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

from fleetllm.engine.llm import LLM
from fleetllm.engine.params import SamplingParams
from fleetllm.structured.spec import GrammarSpec

SCHEMA = {"type": "array", "minItems": 30, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["name", "score"], "additionalProperties": False}}
PROMPT = "List players and their scores as a JSON array of objects with name and score."


def tok_s(llm: LLM, concurrency: int, max_tokens: int, spec: GrammarSpec | None) -> tuple[float, float]:
    """Output tokens per wall second and per CPU second of this process, of ``concurrency`` requests run
    together (sampled, distinct seeds). CPU seconds are less disturbed by other work on a shared host."""
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=spec is None,
                             structured=spec) for i in range(concurrency)]
    t0, c0 = time.perf_counter(), time.process_time()
    results = llm.generate([ids] * concurrency, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(r.outputs[0].token_ids) for r in results)
    return n / dt, n / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    llm = LLM(args.model, num_threads=args.threads)
    spec = GrammarSpec.json_schema(SCHEMA)
    tok_s(llm, 2, 4, spec)  # warm: the grammar's tokenizer and first masks, the engine's first steps
    print("| concurrency | unconstrained tok/s | JSON schema tok/s | ratio | unconstrained tok/CPU-s "
          "| JSON schema tok/CPU-s | ratio |\n|---:|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        rounds = [(tok_s(llm, c, args.max_tokens, None), tok_s(llm, c, args.max_tokens, spec))
                  for _ in range(args.repeat)]  # interleaved: a burst of load elsewhere hits both alike
        free = [max(r[0][k] for r in rounds) for k in (0, 1)]
        constrained = [max(r[1][k] for r in rounds) for k in (0, 1)]
        print(f"| {c} | {free[0]:.1f} | {constrained[0]:.1f} | {constrained[0] / free[0]:.2f} "
              f"| {free[1]:.1f} | {constrained[1]:.1f} | {constrained[1] / free[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
