"""What writing a prompt's KV into another pool costs the prefill itself (issue #21), in one process on one core.

Fresh 2,048-token prompts prefilled by one engine (one torch thread, pinned to one core), three ways in turn:

- **own pool**: a plain prefill (the reference);
- **in place**: computed in blocks of a second pool, a shared-memory file as a decode worker's (what a
  prefill worker does since the in-place write: ``LayerStream(..., in_place=True)``);
- **copy after each layer**: computed in its own pool, each layer's blocks copied into the second pool by the
  layer hooks (what a prefill worker did before, and a worker of role ``both`` still does).

The second pool's pages are all touched first (a decode worker that has served a while). Each round starts with
the next way; the table gives each way's median and its ratio to the reference, by round too.

    python benchmarks/prefill_in_place.py --rounds 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402

from fleetllm.disagg.connector import pd_connector
from fleetllm.disagg.direct import PoolTarget  # noqa: E402
from fleetllm.disagg.kv_io import frame_header  # noqa: E402
from fleetllm.disagg.layer_stream import LayerStream  # noqa: E402
from fleetllm.engine.block_pool import hash_prefix_blocks  # noqa: E402
from fleetllm.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from fleetllm.engine.kv_memory import kv_memory, shm_dir  # noqa: E402
from fleetllm.engine.sampling import SamplingParams  # noqa: E402

WAYS = ("own pool", "in place", "copy after each layer")


def second_pool(engine: LLMEngine) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], object]:
    """A pool laid out as ``engine``'s, in a shared-memory file, every page touched; its per-layer block views."""
    views = engine.kv_blocks()
    shape = views[0][0].shape
    flat, f = kv_memory(2 * len(views) * views[0][0].numel(), views[0][0].dtype, "cpu", shm_dir())
    flat.fill_(0.0)
    per = flat.view(2 * len(views), *shape)
    return [(per[2 * i], per[2 * i + 1]) for i in range(len(views))], f


def prefill(engine: LLMEngine, rid: str, ids: list[int], stream: LayerStream | None) -> float:
    """Seconds to the first token of ``ids`` (``stream``: observing the request)."""
    if stream is not None:
        pd_connector(engine).observe(rid, stream)
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t0
    if stream is not None:
        pd_connector(engine).observe(rid, None)
        stream.done.result(timeout=60)
        stream.close()
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--out", default="results/prefill_in_place")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    engine = LLMEngine(EngineConfig(num_threads=1, enable_prefix_caching=False, kv_cache_gb=0.5))
    other, f = second_pool(engine)
    bs, rng = engine.pool.block_size, random.Random(0)
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds + 1):  # the first round warms up, unreported
        for w in WAYS[r % 3:] + WAYS[: r % 3]:
            ids = [rng.randrange(100, 40000) for _ in range(args.tokens)]
            header = frame_header(engine, ids, hash_prefix_blocks(ids, bs, engine.kv.extra_key), tail=True)
            blocks = list(range(header.num_blocks))  # the second pool's blocks: nobody else uses them
            target = PoolTarget(header, other, blocks, math.inf)
            stream = None if w == "own pool" else LayerStream(target, in_place=w == "in place")
            dt = prefill(engine, f"{w}-{r}", ids, stream)
            if r:
                times[w].append(dt)
    load.append(os.getloadavg()[0])
    ref = times["own pool"]
    lines = ["| way | median s [range] | / own pool | by round: median [range] |", "|---|---|---|---|"]
    for w, ts in times.items():
        rounds = [t / o for t, o in zip(ts, ref, strict=True)]
        lines.append(f"| {w} | {median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}] | {median(ts) / median(ref):.4f} | "
                     f"{median(rounds):.4f} [{min(rounds):.4f}-{max(rounds):.4f}] |")
    print("\n".join(lines))
    print(f"{args.tokens}-token prompts, {args.rounds} rounds, core {args.core}; load average {load[0]:.2f} before, "
          f"{load[1]:.2f} after")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_in_place.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "cpu": cpu_model(), "times": times, "load": load, "table": lines,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2))
    del f
    return 0


if __name__ == "__main__":
    sys.exit(main())
