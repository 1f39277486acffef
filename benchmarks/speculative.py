"""Speculative decoding on this machine: output tok/s and acceptance length per method, K and concurrency.

One process, one copy of the weights, an in-process engine per configuration (no HTTP, so the figures
are the engine's). Held-out prompts (none of them built from the training templates or stdlib files):
chat, code, and agentic tool-output copying. A closed loop keeps ``c`` requests in flight. Greedy.
At concurrency 1 and 4 K is fixed (adaptive=0) so methods compare as drafters; at concurrency 16 every
method runs with its default adaptive K, which is what a server would use. Ratios are against "none"
measured in the same run. Writes JSON (``--output``) and prints a Markdown table.

    python benchmarks/speculative.py --output /tmp/spec.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402

from fleetllm import LLM, SamplingParams  # noqa: E402
from fleetllm.models.loader import load_model  # noqa: E402

TOOL_JSON = json.dumps({"status": "error", "code": "E_QUOTA", "region": "eu-west-3", "used_gb": 981.4, "limit_gb": 1000,
                        "resources": [{"id": "vol-0a12", "size_gb": 512}, {"id": "vol-7f3c", "size_gb": 469.4}]})
TOOL_LOG = ("2026-11-30T10:01:02Z worker-3 ERROR request 8812 timed out after 30s (upstream=search-svc)\n"
            "2026-11-30T10:01:05Z worker-3 WARN retrying request 8812 (attempt 2 of 3)\n"
            "2026-11-30T10:01:09Z worker-3 ERROR request 8812 timed out after 30s (upstream=search-svc)\n")
PROMPTS = {
    "chat": [
        "What are three tips for sleeping better?",
        "Describe a sunset over the mountains in two sentences.",
        "Why do cats purr?",
        "Plan a one-day trip to Paris.",
    ],
    "code": [
        "Write a Python function is_palindrome(s) that ignores case and spaces.",
        "Here is a function:\n```python\ndef area(w, h):\n    return w * h\n```\nAdd type hints and a docstring, and repeat the full function.",
        "Write a Python class Counter with methods increment, decrement and reset.",
        "Fix the bug and show the corrected code:\n```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)\n```",
    ],
    "agentic": [
        f"The tool `get_quota` returned:\n{TOOL_JSON}\nReport the tool result to the user, quoting the JSON exactly.",
        f"Command output:\n{TOOL_LOG}\nCopy the ERROR lines exactly, then say what failed.",
        f"The search tool returned:\n{TOOL_JSON}\nList each resource id with its size, in the same format as the JSON.",
        f"Log:\n{TOOL_LOG}\nRepeat the log verbatim, then summarise it in one line.",
    ],
}


def configs(concurrency: int) -> list[tuple[str, str | None]]:
    if concurrency >= 16:
        return [("none", None), ("ngram", "method=ngram,k=4"), ("suffix", "method=suffix,k=4"),
                ("eagle", "method=eagle,k=4"), ("peagle", "method=peagle,k=4")]
    fixed = [("none", None), ("ngram k=4", "method=ngram,k=4,adaptive=0"), ("suffix k=4", "method=suffix,k=4,adaptive=0")]
    for m in ("eagle", "peagle"):
        fixed += [(f"{m} k={k}", f"method={m},k={k},adaptive=0") for k in ((2, 4) if concurrency == 1 else (4,))]
    return fixed + ([("peagle auto", "method=peagle")] if concurrency == 1 else [])


def run(loaded, spec: str | None, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    llm = LLM(loaded=loaded, num_blocks=1024, max_num_seqs=max(concurrency, 1), speculative=spec)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    eng.pool.reset_prefix_cache()
    counters = ("num_drafts", "num_draft_tokens", "num_accepted", "draft_seconds", "verify_seconds")
    before = {n: getattr(eng.spec, n) for n in counters} if eng.spec else {}
    queue = list(enumerate(prompts))
    inflight, tokens = 0, 0
    t0 = time.perf_counter()
    while queue or eng.has_unfinished():
        while queue and inflight < concurrency:
            i, ids = queue.pop(0)
            eng.add_request(f"r{i}", ids, params)
            inflight += 1
        for out in eng.step():
            tokens += len(out.new_token_ids)
            inflight -= out.finished
    wall = time.perf_counter() - t0
    res = {"tokens": tokens, "seconds": round(wall, 2), "tok_s": round(tokens / wall, 2), "al": 1.0}
    if eng.spec:
        d = {n: getattr(eng.spec, n) - before[n] for n in counters}
        res.update(al=round(1 + d["num_accepted"] / max(d["num_drafts"], 1), 2), drafts=d["num_drafts"],
                   draft_tokens=d["num_draft_tokens"], accepted=d["num_accepted"], draft_s=round(d["draft_seconds"], 2),
                   verify_s=round(d["verify_seconds"], 2))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,16,4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per category at concurrency 1")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    ids = {cat: [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ps]
           for cat, ps in PROMPTS.items()}
    results = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        # c < 16: each category on its own (the batch holds one kind of text); c = 16: all mixed, 16 requests
        groups = {cat: v[: max(c, args.prompts)] for cat, v in ids.items()} if c < 16 else {
            "mixed": [p for v in ids.values() for p in v] + [p for v in ids.values() for p in v][: 16 - 12]}
        for name, spec in configs(c):
            for cat, prompts in groups.items():
                r = run(loaded, spec, prompts, c, args.max_tokens)
                r.update(method=name, spec=spec, concurrency=c, category=cat, requests=len(prompts))
                results.append(r)
                print(json.dumps(r), flush=True)
    for r in results:
        base = next(b for b in results if b["method"] == "none" and b["concurrency"] == r["concurrency"]
                    and b["category"] == r["category"])
        r["vs_none"] = round(r["tok_s"] / base["tok_s"], 2)
    from fleetllm.spec.decoder import StepCost

    step_cost = {n: round(t * 1000, 1) for times in StepCost._cache.values() for n, t in zip(StepCost.SIZES, times, strict=True)}
    print(f"\n{cpu_model()}, {args.threads} threads, greedy, max_tokens {args.max_tokens}")
    print(f"measured target step time (ms) by tokens in the step: {step_cost}\n")
    print("| c | category | method | tok/s | ×none | AL | draft s | verify s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['concurrency']} | {r['category']} | {r['method']} | {r['tok_s']} | {r['vs_none']} | {r['al']} "
              f"| {r.get('draft_s', '')} | {r.get('verify_s', '')} |")
    if args.output:
        args.output.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "step_ms": step_cost, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
