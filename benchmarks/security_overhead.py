"""What the security checks cost: a fleet from this checkout against the same fleet from an older one, one run.

Issue #36 put credentials before every route (the worker secret on every worker path, the admin token, the
API key checked before a body is read), bounded every body and validated every number at the API edge. This
measures what that costs where it would show: output-token throughput through the router.

What it does:
  1. makes an API keys file (one key, no limits) and a fleet YAML (one SmolLM2 worker, keys on);
  2. starts that fleet twice with ``fleetllm serve``: ``before`` from ``--before DIR`` (a checkout of the
     commit before the checks, e.g. ``git worktree add --detach /tmp/before 7c76181``) and ``after`` from
     this checkout, each with its own tree first on ``PYTHONPATH``;
  3. drives them in turn with ``fleetllm bench`` (streaming chat with the key, closed loop, fixed concurrency
     and request count, exactly ``--osl`` output tokens), alternating which goes first, for ``--rounds``
     rounds, so drift in the machine's load hits both alike (only one fleet is ever under load);
  4. prints each run's output tok/s, the medians and the ratio after / before (goal: >= 0.97).

Run:  python benchmarks/security_overhead.py --before /tmp/before [--concurrency 4 --requests 32 --rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, free_ports, stop_process, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def make_key(tmp: Path, tree: Path) -> tuple[Path, str]:
    """A keys file with one unlimited key, and the key itself, made by ``tree``'s fleetllm (the older checkout's:
    a newer keys file can carry fields an older router does not know, never the other way round)."""
    keys = tmp / "keys.yaml"
    out = subprocess.run([sys.executable, "-m", "fleetllm.cli", "keys", "--file", str(keys), "create",
                          "--name", "bench"], capture_output=True, text=True, check=True, cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)})
    key = next(w for w in out.stdout.split() if w.startswith("flk-"))
    return keys, key


def serve(tree: Path, port: int, keys: Path, tmp: Path, name: str) -> subprocess.Popen[bytes]:
    """``fleetllm serve`` from ``tree`` (its fleetllm first on the path), once the router answers /health."""
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"models": [{"name": "smollm2-135m", "source": "smollm2-135m"}],
                                   "keys_file": str(keys)}))
    log = tmp / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fleetllm.cli", "serve", "--config", str(cfg), "--port", str(port),
           "--log-dir", str(tmp / f"{name}-logs")]
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}/health", proc, log, timeout=300)
    return proc


def bench(url: str, key: str, args: argparse.Namespace, out: Path) -> float:
    """Output tok/s of one ``fleetllm bench`` run against ``url``."""
    cmd = [sys.executable, "-m", "fleetllm.cli", "bench", "--url", url, "--model", "smollm2-135m", "--api-key", key,
           "--concurrency", str(args.concurrency), "--requests", str(args.requests), "--isl", str(args.isl),
           "--osl", str(args.osl), "--warmup-requests", "2", "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800, cwd=ROOT)
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    if summary["requests"]["errors"]:
        raise RuntimeError(f"{url}: {summary['errors_by_kind']}")
    return float(summary["output_token_throughput"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the commit before the checks")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not (args.before / "fleetllm" / "__init__.py").is_file():
        ap.error(f"--before {args.before}: not a fleetllm checkout (no fleetllm/__init__.py there)")
    tmp = Path(tempfile.mkdtemp(prefix="fleetllm-security-overhead-"))
    keys, key = make_key(tmp, args.before.resolve())
    base = free_ports(4)  # each fleet: its router's port, then its worker's (serve's default: port + 1)
    trees = {"before": args.before.resolve(), "after": ROOT}
    ports = {"before": base, "after": base + 2}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    tput: dict[str, list[float]] = {"before": [], "after": []}
    try:
        for name, tree in trees.items():
            procs[name] = serve(tree, ports[name], keys, tmp, name)
        for r in range(args.rounds):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                v = bench(f"http://127.0.0.1:{ports[name]}", key, args, tmp / f"{name}-{r}.json")
                tput[name].append(v)
                print(f"round {r + 1} {name:6s}: {v:7.2f} output tok/s", flush=True)
    finally:
        for p in procs.values():
            stop_process(p)
    before, after = statistics.median(tput["before"]), statistics.median(tput["after"])
    print(f"{cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"median output tok/s: before {before:.2f}, after {after:.2f}; ratio after/before {after / before:.3f} "
          f"(goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
