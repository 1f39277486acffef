"""The router's per-request decision cost: each policy's ``choose`` in this checkout against a git revision's
``fleetllm/router/policies.py``, interleaved in one process (median of ``--rounds`` rounds, each the best of
``--repeats`` timed loops), on the same worker states, index and prompt (64 blocks of 16 tokens, half the workers
holding a random share of it), at 8 and 32 workers.

Run:  python benchmarks/routing_cost.py [--baseline 8ea1574] [--rounds 5] [--record]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import save_run  # noqa: E402

from fleetllm.router import policies  # noqa: E402
from fleetllm.router.index import PrefixIndex  # noqa: E402
from fleetllm.router.upstream import WorkerState  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BLOCKS = 64


def policies_at(rev: str):  # noqa: ANN201 (a module)
    """``fleetllm/router/policies.py`` at ``rev``, loaded as its own module."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:fleetllm/router/policies.py"], capture_output=True,
                         text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "policies_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("policies_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def fleet(n: int, seed: int) -> tuple[list[WorkerState], PrefixIndex]:
    rng = random.Random(seed)
    index = PrefixIndex(300)
    ws = []
    for i in range(n):
        w = WorkerState(f"w{i}", f"http://w{i}", healthy=True, block_size=16)
        w.inflight, w.decoding, w.waiting, w.kv_usage = rng.randint(0, 8), rng.randint(0, 4), rng.randint(0, 2), rng.random()
        ws.append(w)
        if i % 2 == 0:
            index.record_routed(w.name, list(range(rng.randint(1, BLOCKS))))
    return ws, index


def per_decision_us(module, name: str, ws: list[WorkerState], index: PrefixIndex, repeats: int, loops: int) -> float:  # noqa: ANN001
    p = module.make_policy(name, index, seed=0)
    req = module.RouteRequest(num_prompt_tokens=BLOCKS * 16 + 5, block_hashes=list(range(BLOCKS)), block_size=16,
                              session_key="user-7")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            p.choose(req, ws)
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="8ea1574", help="a revision before the pipeline (main before it merged)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loops", type=int, default=200)
    ap.add_argument("--record", action="store_true", help="write results/<section>.md")
    args = ap.parse_args()
    old = policies_at(args.baseline)
    rows = []
    for n in (8, 32):
        ws, index = fleet(n, n)
        for name in policies.POLICY_NAMES:
            before, after = [], []
            for r in range(args.rounds):
                pair = [(old, before), (policies, after)]
                for module, out in pair if r % 2 == 0 else pair[::-1]:
                    out.append(per_decision_us(module, name, ws, index, args.repeats, args.loops))
            b, a = statistics.median(before), statistics.median(after)
            rows.append(f"| {n} | {name} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
            print(rows[-1], flush=True)
    table = "| workers | policy | before µs | after µs | after/before |\n|---:|---|---:|---:|---:|\n" + "\n".join(rows)
    if args.record:
        save_run("## Routing cost", f"`choose()` per request, {args.baseline} against this checkout (the router as a "
                 "pipeline of stages), median of rounds.", " ".join(sys.argv), table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
