"""What a P/D KV import costs the decode worker, in-process on a real SmolLM2 engine (issue #17).

For frames of several prompt sizes: the decode side's CRC pass and copy into reserved pool blocks
(:mod:`fleetllm.disagg.import_cost`), into pool pages never touched before (a fresh worker's pool: what a
fleet run sees) and into pages already written, as bytes/s; then the share of an import's seconds that
decode steps running beside it on the same core lose (``steal``), and how long the import itself took
meanwhile. These are the two parameters the recommender's fleet simulator models the import with
(``kv_import_bytes_per_s`` and ``kv_import_steal`` of the timing profile).

    PYTHONPATH=. python benchmarks/kv_import_cost.py --tokens 272,512,2048 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from fleetllm.disagg.import_cost import FrameMaker, decode_steal, import_frame, touch_pool
from fleetllm.engine.engine import EngineConfig, LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="272,512,2048", help="prompt tokens per frame (full blocks travel)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=Path, default=Path("results/kv_import_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model="smollm2-135m", num_threads=1, kv_cache_gb=1.0))
    maker = FrameMaker(eng)
    sizes = [int(t) for t in args.tokens.split(",")]
    rows = {}
    for pages in ("fresh", "warm"):
        if pages == "warm":
            touch_pool(eng)
        for n in sizes:
            runs = [import_frame(eng, maker.frame(n)) for _ in range(args.repeats)]
            rows[f"{pages} {n}"] = {"tokens": n, "pages": pages, "mb": runs[0].nbytes / 1e6,
                                    "verify_s": statistics.median(r.verify_s for r in runs),
                                    "copy_s": statistics.median(r.copy_s for r in runs),
                                    "gb_per_s": statistics.median(r.bytes_per_s for r in runs) / 1e9}
    fresh = LLMEngine(EngineConfig(model="smollm2-135m", num_threads=1, kv_cache_gb=1.0))
    n = max(sizes)
    rate = rows[f"fresh {n}"]["gb_per_s"] * 1e9
    steal = [decode_steal(fresh, FrameMaker(fresh, seed=100 * r), n, rate) for r in range(args.repeats)]
    doc = {"rows": list(rows.values()), "steal_tokens": n, "steal": statistics.median(s for s, _ in steal),
           "import_s_beside_decode": statistics.median(t for _, t in steal)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print("| pool pages | prompt tokens | frame MB | verify (CRC) ms | copy ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows.values():
        print(f"| {r['pages']} | {r['tokens']} | {r['mb']:.1f} | {r['verify_s'] * 1e3:.1f} | {r['copy_s'] * 1e3:.1f} "
              f"| {r['gb_per_s']:.2f} |")
    print(f"steal (decode batch 4 beside a {n}-token import, one core): {doc['steal']:.2f} of the import's "
          f"seconds alone; the import took {doc['import_s_beside_decode'] * 1e3:.0f} ms beside the steps "
          f"({rows[f'fresh {n}']['mb'] / rate * 1e9:.0f} ms alone)")


if __name__ == "__main__":
    main()
