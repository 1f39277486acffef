"""Two routers, one key limited to 60 requests per minute, clients spread over both: what gets admitted.

A simulated worker (``fleetllm worker --simulate``) behind two ``fleetllm router`` processes with one keys
file; clients send the key's requests at ``--rate`` per second (above its limit) alternately to the two
routers for ``--duration`` seconds. Three runs:

- ``alone``: no ``--state-url`` (each router enforces the limit on its own: about twice the limit admitted);
- ``shared``: both routers on one ``redis-server`` (the limit holds across them);
- ``redis killed``: shared, and Redis killed (SIGKILL) half-way: no request may fail (the routers fall back
  to their own limits, so the second half admits up to twice the limit, as ``alone`` does).

Reported per run: requests admitted (200) per minute of the run, refused (429), and failed (anything else).

    python benchmarks/shared_limits.py                     # 2 minutes per run
    python benchmarks/shared_limits.py --duration 60 --runs shared
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import free_ports, save_run, stop_process, wait_healthy  # noqa: E402

from fleetllm.fleet.redis_server import RedisServer  # noqa: E402
from fleetllm.router.keys import KeyStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "fleetllm.cli"]
RUNS = ("alone", "shared", "redis-killed")


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(CLI + args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)


async def load(urls: list[str], key: str, rate: float, duration: float,
               midway: asyncio.Event) -> list[tuple[float, int]]:
    """(seconds since start, status or 0 for a transport failure) of every request sent."""
    out: list[tuple[float, int]] = []
    body = {"prompt": "hello", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:

        async def one(i: int, t: float) -> None:
            try:
                r = await client.post(urls[i % len(urls)] + "/v1/completions", json=body)
                out.append((t, r.status_code))
            except httpx.HTTPError:
                out.append((t, 0))

        t0, tasks, i = time.monotonic(), [], 0
        while (t := time.monotonic() - t0) < duration:
            if t >= duration / 2:
                midway.set()
            tasks.append(asyncio.create_task(one(i, t)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        await asyncio.gather(*tasks)
    return out


async def run_once(kind: str, worker: str, keys: Path, key: str, args: argparse.Namespace, logs: Path) -> str:
    store = RedisServer().start() if kind != "alone" else None
    ports = free_ports(2)
    routers, urls = [], []
    try:
        for j in range(2):
            url = f"http://127.0.0.1:{ports + j}"
            flags = ["router", "--workers", worker, "--policy", "round_robin", "--port", str(ports + j),
                     "--keys-file", str(keys), "--log-level", "warning"]
            if store is not None:
                flags += ["--state-url", store.url]
            log = logs / f"{kind}-router{j}.log"
            routers.append(start(flags, log))
            wait_healthy(url + "/health", routers[-1], log, 120)
            urls.append(url)
        midway = asyncio.Event()
        if kind == "redis-killed":
            async def kill_midway() -> None:
                await midway.wait()
                store.kill()
            killer = asyncio.create_task(kill_midway())
        results = await load(urls, key, args.rate, args.duration, midway)
        if kind == "redis-killed":
            killer.cancel()
    finally:
        for p in routers:
            stop_process(p)
        if store is not None:
            store.stop()
    return summarize(kind, results, args.duration)


def summarize(kind: str, results: list[tuple[float, int]], duration: float) -> str:
    admitted = sum(1 for _, s in results if s == 200)
    refused = sum(1 for _, s in results if s == 429)
    failed = len(results) - admitted - refused
    minutes = [sum(1 for t, s in results if s == 200 and m * 60 <= t < (m + 1) * 60) for m in range(int(duration // 60))]
    return (f"| {kind} | {len(results)} | {admitted / (duration / 60):.1f} | {', '.join(map(str, minutes))} | "
            f"{refused} | {failed} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second, both routers together")
    ap.add_argument("--rpm-limit", type=int, default=60)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleetllm-shared-limits-") as tmp:
        logs = Path(tmp)
        keys = KeyStore(logs / "keys.yaml")
        _, key = keys.create("bench", rpm_limit=args.rpm_limit)
        wport = free_ports(1)
        worker = f"http://127.0.0.1:{wport}"
        wlog = logs / "worker.log"
        wproc = start(["worker", "--simulate", "--port", str(wport), "--sim-speed", "10", "--log-level", "warning"],
                      wlog)
        try:
            wait_healthy(worker + "/health", wproc, wlog, 120)
            rows = [asyncio.run(run_once(kind, worker, keys.path, key, args, logs)) for kind in args.runs.split(",")]
        finally:
            stop_process(wproc)
    lines = ("| run | sent | admitted / min | admitted in each minute | refused (429) | failed |\n"
             "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(lines)
    save_run("## Shared limits: two routers, one key", f"One key at {args.rpm_limit} requests/min, {args.rate:g} "
             f"requests/s sent alternately to two routers over one simulated worker, {args.duration:g} s per run; "
             "redis-killed: Redis SIGKILLed half-way.", " ".join(sys.argv), lines)


if __name__ == "__main__":
    main()
