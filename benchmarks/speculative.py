"""Speculative decoding on this machine: output tok/s and acceptance length per method, K and concurrency.

One process, one copy of the weights, an in-process engine per configuration (no HTTP, so the figures
are the engine's). Held-out prompts (none of them built from the training templates or stdlib files):
chat, code, and agentic tool-output copying. A closed loop keeps ``c`` requests in flight. Greedy.
At concurrency 1 and 4 K is fixed (adaptive=0) so methods compare as drafters; at concurrency 16 every
method runs with its default adaptive K, which is what a server would use. On a shared machine the
speed drifts by minutes, so every method runs on the same unit of work back to back (one prompt at
c=1, one batch otherwise) and the ratio to "none" is taken unit by unit: x none = the time "none"
would have taken for the same tokens / the time taken. "x none CPU" is the same ratio in CPU seconds
of this process (all threads): other tenants' load stretches wall time but not CPU time, so it is the
steadier figure here, though it undercounts a method that keeps both threads busier than "none".
Writes JSON and a plot (``--output``) and prints a Markdown table.

    python benchmarks/speculative.py --output /tmp/spec.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402

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


def configs(concurrency: int, ks: tuple[int, ...]) -> list[tuple[str, str | None]]:
    if concurrency >= 16:
        return [("none", None), ("ngram", "method=ngram,k=4"), ("suffix", "method=suffix,k=4"),
                ("eagle", "method=eagle,k=4"), ("peagle", "method=peagle,k=4")]
    fixed = [("none", None), ("ngram k=4", "method=ngram,k=4,adaptive=0"), ("suffix k=4", "method=suffix,k=4,adaptive=0")]
    for k in ks if concurrency == 1 else (4,):
        fixed += [(f"{m} k={k}", f"method={m},k={k},adaptive=0") for m in ("eagle", "peagle")]
    auto = [("suffix auto", "method=suffix"), ("peagle auto", "method=peagle")]  # K from acceptance and cost, up to 8
    return fixed + (auto if concurrency == 1 else [])


COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted", "draft_seconds", "verify_seconds")


def run(loaded, spec: str | None, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """One configuration over ``prompts`` with ``concurrency`` in flight: tokens, seconds, spec counters."""
    llm = LLM(loaded=loaded, num_blocks=1024, max_num_seqs=max(concurrency, 1), speculative=spec)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    eng.pool.reset_prefix_cache()
    before = {n: getattr(eng.spec, n) for n in COUNTERS} if eng.spec else {}
    queue = list(enumerate(prompts))
    inflight, tokens = 0, 0
    t0, c0 = time.perf_counter(), time.process_time()
    while queue or eng.has_unfinished():
        while queue and inflight < concurrency:
            i, ids = queue.pop(0)
            eng.add_request(f"r{i}", ids, params)
            inflight += 1
        for out in eng.step():
            tokens += len(out.new_token_ids)
            inflight -= out.finished
    res = {"tokens": tokens, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    if eng.spec:
        res.update({n: getattr(eng.spec, n) - before[n] for n in COUNTERS})
    return res


def none_took(mine: list[dict], base: dict[str, dict], field: str) -> float:
    """What ``none`` spent (``field``: seconds or cpu_seconds) on the tokens ``mine`` produced, unit by unit."""
    return sum(base[r["unit"]][field] * r["tokens"] / base[r["unit"]]["tokens"] for r in mine)


def summarise(runs: list[dict]) -> list[dict]:
    """Per (concurrency, category, method): tok/s over all its runs, and its ratio to ``none`` taken
    unit by unit (each unit = one prompt at c=1, one batch otherwise, every method back to back)."""
    rows = []
    method_order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in runs))}
    keys = sorted({(r["concurrency"], r["category"], r["method"]) for r in runs},
                  key=lambda k: (k[0], list(PROMPTS).index(k[1]) if k[1] in PROMPTS else 9, method_order[k[2]]))
    for c, cat, method in keys:
        mine = [r for r in runs if (r["concurrency"], r["category"], r["method"]) == (c, cat, method)]
        base = {r["unit"]: r for r in runs if (r["concurrency"], r["category"], r["method"]) == (c, cat, "none")}

        tok, sec = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
        ratios = sorted((r["tokens"] / r["seconds"]) / (base[r["unit"]]["tokens"] / base[r["unit"]]["seconds"]) for r in mine)
        row = {"concurrency": c, "category": cat, "method": method, "units": len(mine), "tok_s": round(tok / sec, 2),
               "vs_none": round(none_took(mine, base, "seconds") / sec, 2), "vs_none_min": round(ratios[0], 2),
               "vs_none_median": round(statistics.median(ratios), 2),
               "vs_none_max": round(ratios[-1], 2),
               "vs_none_cpu": round(none_took(mine, base, "cpu_seconds") / sum(r["cpu_seconds"] for r in mine), 2),
               "al": 1.0, "spec": mine[0]["spec"]}
        if "num_drafts" in mine[0]:
            d = {n: sum(r[n] for r in mine) for n in COUNTERS}
            row.update(al=round(1 + d["num_accepted"] / max(d["num_drafts"], 1), 2), draft_s=round(d["draft_seconds"], 2),
                       verify_s=round(d["verify_seconds"], 2), drafts=d["num_drafts"], accepted=d["num_accepted"])
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category at concurrency 1 (max 4)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every unit (a prompt at c=1, a batch above)")
    ap.add_argument("--ks", default="2,4", help="fixed K for eagle / peagle at concurrency 1")
    ap.add_argument("--categories", default="chat,code,agentic", help="categories at concurrency < 16")
    ap.add_argument("--methods", default=None, help="keep only these rows, comma-separated (e.g. 'eagle k=4,peagle k=4'); none always runs")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    keep = None if not args.methods else {m.strip() for m in args.methods.split(",")} | {"none"}
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    ids = {cat: [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ps]
           for cat, ps in PROMPTS.items()}
    ks = tuple(int(k) for k in args.ks.split(","))
    cats = args.categories.split(",")
    units = []  # (concurrency, category, unit id, prompts): every method runs on a unit back to back
    for c in [int(x) for x in args.concurrency.split(",")]:
        if c == 1:
            units += [(1, cat, f"{cat}{i}-r{r}", [v[i]]) for r in range(args.rounds) for i in range(args.prompts)
                      for cat, v in ids.items() if cat in cats]
        elif c < 16:  # each category on its own: the batch holds one kind of text
            units += [(c, cat, f"{cat}-r{r}", v[:c]) for r in range(args.rounds) for cat, v in ids.items() if cat in cats]
        else:
            mixed = [p for v in ids.values() for p in v]
            units += [(c, "mixed", f"mixed-r{r}", (mixed * 2)[:c]) for r in range(args.rounds)]
    runs = []
    def chosen(c: int) -> list[tuple[str, str | None]]:
        return [(n, sp) for n, sp in configs(c, ks) if keep is None or n in keep]

    total = sum(len(chosen(c)) for c, *_ in units)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("runs", total=total)
        for c, cat, unit, prompts in units:
            for name, spec in chosen(c):
                bar.update(task, description=f"c={c} {unit} {name}")
                r = run(loaded, spec, prompts, c, args.max_tokens)
                r.update(method=name, spec=spec, concurrency=c, category=cat, unit=unit)
                runs.append(r)
                bar.advance(task)
    rows = summarise(runs)
    from fleetllm.speculative.step_cost import _MEASURED

    step_cost: dict[int | str, float] = {}
    for c in (c for per_model in _MEASURED.values() for c in per_model.values()):  # one: every engine here shares them
        step_cost = {n: round(t * 1000, 1) for n, t in zip(c.sizes, c.times, strict=True)}
        step_cost["per verify"] = round(c.per_verify * 1000, 1)
    print(f"\n{cpu_model()}, {args.threads} threads, greedy, max_tokens {args.max_tokens}")
    print(f"measured target step time (ms) by rows in the step: {step_cost}\n")
    print("| c | category | method | units | tok/s | ×none | ×none median | ×none range | ×none CPU | AL | draft s | verify s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['category']} | {r['method']} | {r['units']} | {r['tok_s']} | {r['vs_none']} "
              f"| {r['vs_none_median']} "
              f"| {r['vs_none_min']}–{r['vs_none_max']} | {r['vs_none_cpu']} | {r['al']} | {r.get('draft_s', '')} "
              f"| {r.get('verify_s', '')} |")
    if args.output:
        args.output.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "step_ms": step_cost,
                                           "rows": rows, "runs": runs}, indent=1))
        plot(rows, args.output.with_suffix(".png"))
        print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """One panel per concurrency: x none (wall, with the unit-by-unit range) per method and category, AL on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(len(concs), 1, figsize=(13, 3.6 * len(concs)), squeeze=False)
    for ax, c in zip(axes[:, 0], concs, strict=True):
        mine = [r for r in rows if r["concurrency"] == c]
        cats = list(dict.fromkeys(r["category"] for r in mine))
        methods = list(dict.fromkeys(r["method"] for r in mine))
        width = 0.85 / len(methods)
        for k, m in enumerate(methods):
            for x, cat in enumerate(cats):
                r = next((r for r in mine if r["method"] == m and r["category"] == cat), None)
                if r is None:
                    continue
                pos = x + k * width
                err = [[r["vs_none"] - r["vs_none_min"]], [r["vs_none_max"] - r["vs_none"]]]
                ax.bar(pos, r["vs_none"], width, color=plt.cm.tab20(k), yerr=err, capsize=2, label=m if x == 0 else None)
                ax.text(pos, r["vs_none"] + 0.03, f"{r['al']:.1f}", ha="center", fontsize=6)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([x + 0.425 - width / 2 for x in range(len(cats))], cats)
        ax.set_ylabel("× none (output tok/s)")
        ax.set_title(f"concurrency {c} (bar labels: acceptance length AL)")
        ax.legend(fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
