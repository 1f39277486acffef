"""A prefix another engine computed, loaded from a KV tier, against computing it again (issue #38).

Each round: a writer engine (`LLM` with the disk and the shared Redis tiers) prefills a fresh ``--tokens``-token
prompt and finishes its tiers' writes; then three fresh engines over the same weights, each with an empty pool,
answer the same prompt with one token: one with no tier (recomputes: what a worker that never saw the prefix
does today), one with the disk tier (a restarted worker on the same node), one with the Redis tier (another copy
that never saw it). Time to first token of each, medians over ``--rounds``, and the ratios. Goals: the shared tier
and the disk tier ≥ 5x faster than recomputing. A private ``redis-server`` on 127.0.0.1 is started and stopped.

    python benchmarks/kv_tiers.py [--tokens 2048 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model  # noqa: E402

from fleetllm import LLM, SamplingParams  # noqa: E402
from fleetllm.fleet.redis_server import RedisServer  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first (only) token, and the token."""
    t0 = time.perf_counter()
    out = llm.generate(ids, ONE)[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    redis = RedisServer().start()
    disk = tempfile.TemporaryDirectory(prefix="fleetllm-kv-tiers-")
    tiers = {"disk": {"kv_disk_dir": disk.name, "kv_disk_gb": 4.0}, "remote": {"kv_remote": redis.url}}
    times: dict[str, list[float]] = {"recompute": [], "disk": [], "remote": []}
    try:
        writer = LLM("smollm2-135m", kv_disk_dir=disk.name, kv_disk_gb=4.0, kv_remote=redis.url)
        loaded = writer.engine.loaded
        for r in range(args.rounds):
            rng = random.Random(1000 + r)
            ids = [rng.randrange(100, 40000) for _ in range(args.tokens)]
            writer.generate(ids, ONE)
            for t in writer.kv_tiers:
                if hasattr(t, "writer"):
                    t.writer.flush()
            tokens = {}
            for name in ("recompute", "disk", "remote"):
                llm = LLM("smollm2-135m", loaded=loaded, **tiers.get(name, {}))
                s, tokens[name] = ttft(llm, ids)
                llm.close()
                times[name].append(s)
            same = len(set(tokens.values())) == 1
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1] * 1000:.0f} ms" for n, v in times.items())
                  + f"; first token the same on every path: {same}", flush=True)
        writer.close()
    finally:
        redis.stop()
        disk.cleanup()
    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"{cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end; "
          f"{args.tokens}-token prompts, medians of {args.rounds}")
    for name in ("disk", "remote"):
        print(f"{name:6s}: TTFT {med[name] * 1000:.0f} ms vs recompute {med['recompute'] * 1000:.0f} ms: "
              f"{med['recompute'] / med[name]:.1f}x faster (goal >= 5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
