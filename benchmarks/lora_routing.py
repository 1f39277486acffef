"""Routing LoRA adapters (issue #39): 32 adapters on 4 simulated copies of SmolLM2-135M, 8 resident on each.

Each copy serves all 32 adapters (``--lora-modules``: PEFT adapters at the model's shapes, rank 2 on q_proj and
v_proj) with ``--max-loras 8`` slots; before the run, adapter ``i``'s first request goes to copy ``i // 8``, so each
copy holds 8 of them resident. Then an open-loop Poisson load of requests over the 32 adapters (uniform; each
adapter has its own system prompt, each request its own question) goes through a kv_aware router. Reported:

- the share of requests the router sent to a copy holding their adapter resident
  (``fleetllm_router_lora_requests_total{resident}``): goal >= 90%;
- TTFT p50/p90 (streamed, to the first token) against the same workload's requests naming the base model instead
  of an adapter, under round_robin, least_load and kv_aware (fresh copies each): goal within 10% of the best p50.

The simulated copies charge ``--sim-lora-load`` seconds for each adapter a step brings into a slot (on demand, when a
request's adapter is not resident). Run under the benchmarks' lock; the result goes to results/.

    flock /tmp/fleetllm-bench.lock python benchmarks/lora_routing.py
    python benchmarks/lora_routing.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
from common import admin_token, free_ports, save_run, stop_process, wait_healthy  # noqa: E402
from fleet_helpers import smollm2_adapter  # noqa: E402

PY = [sys.executable, "-m", "fleetllm.cli"]
COPIES, ADAPTERS, SLOTS = 4, 32, 8
BASE = "smollm2-135m"  # the simulated copies' model
WORDS = "river mountain ledger invoice harbor signal orbit lantern meadow copper quarry thimble".split()


def prompts(n: int, seed: int) -> list[tuple[int, str]]:
    """``n`` (adapter index, prompt): the adapter's system prompt (~190 tokens) and a question of its own (~40)."""
    rng = random.Random(seed)
    systems = [f"You are assistant {a} of tenant {a}. " + " ".join(rng.choice(WORDS) for _ in range(180))
               for a in range(ADAPTERS)]
    out = []
    for _ in range(n):
        a = rng.randrange(ADAPTERS)
        out.append((a, systems[a] + "\nQuestion: " + " ".join(rng.choice(WORDS) for _ in range(40))))
    return out


def start(adapters: list[str], policy: str, speed: float, load_s: float, tmp: Path) -> tuple[list, str, str]:
    """The simulated copies (one process) and a router over them: (processes, router URL, first worker URL)."""
    port = free_ports(COPIES + 1)
    modules = [f"a{i:02d}={p}" for i, p in enumerate(adapters)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    wlog, rlog = tmp / f"workers-{policy}.log", tmp / f"router-{policy}.log"
    workers = subprocess.Popen([*PY, "worker", "--simulate", "--count", str(COPIES), "--port", str(port + 1),
                                "--enable-lora", "--max-loras", str(SLOTS), "--max-cpu-loras", str(ADAPTERS),
                                "--lora-modules", *modules, "--sim-speed", str(speed), "--sim-lora-load", str(load_s),
                                "--max-num-seqs", "16", "--log-level", "warning", "--disable-log-requests"],
                               stdout=wlog.open("w"), stderr=subprocess.STDOUT, env=env)
    urls = [f"http://127.0.0.1:{port + 1 + i}" for i in range(COPIES)]
    for u in urls:
        wait_healthy(u + "/ready", workers, wlog)
    admin, _ = admin_token(tmp)
    router = subprocess.Popen([*PY, "router", "--workers", ",".join(urls), "--policy", policy, "--port", str(port),
                               "--seed", "1", "--log-level", "warning", *admin],
                              stdout=rlog.open("w"), stderr=subprocess.STDOUT, env=env)
    wait_healthy(f"http://127.0.0.1:{port}/health", router, rlog)
    return [router, workers], f"http://127.0.0.1:{port}", urls


def warm(urls: list[str]) -> None:
    """Adapter ``i``'s first request to copy ``i // SLOTS``: each copy ends holding 8 adapters resident."""
    for i in range(ADAPTERS):
        r = httpx.post(urls[i // SLOTS] + "/v1/completions", json={"model": f"a{i:02d}", "prompt": "warm",
                                                                     "max_tokens": 1}, timeout=60)
        r.raise_for_status()


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, osl: int) -> float:
    t0 = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": osl, "stream": True}
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():  # read to the end: the request holds its copy until then
            if ttft is None and line.startswith("data: ") and '"text"' in line:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft


async def drive(url: str, work: list[tuple[int, str]], rate: float, osl: int, lora: bool, seed: int) -> list[float]:
    """Poisson arrivals at ``rate`` per second; the TTFT of each request."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=512)) as client:
        tasks, t = [], time.perf_counter()
        for a, prompt in work:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, url, f"a{a:02d}" if lora else BASE, prompt, osl)))
        return list(await asyncio.gather(*tasks))


def resident_share(router_url: str) -> tuple[float, int]:
    text = httpx.get(router_url + "/metrics?federate=0", timeout=10).text
    counts = {"true": 0.0, "false": 0.0}
    for m in re.finditer(r'fleetllm_router_lora_requests_total\{[^}]*resident="(true|false)"[^}]*\} ([0-9.e+]+)', text):
        counts[m.group(1)] += float(m.group(2))
    total = counts["true"] + counts["false"]
    return (counts["true"] / total if total else 0.0), int(total)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(adapters: list[str], policy: str, lora: bool, args: argparse.Namespace, tmp: Path) -> dict:
    procs, router_url, urls = start(adapters, policy, args.sim_speed, args.lora_load, tmp)
    try:
        warm(urls)  # (also before the base-model runs: the same copies, the same state)
        time.sleep(1.0)  # the router's view of each copy's adapters (load reports within 50 ms)
        before = resident_share(router_url)
        work = prompts(args.requests, seed=7)
        ttfts = asyncio.run(drive(router_url, work, args.rate, args.osl, lora, seed=11))
        share, n = resident_share(router_url)
        if lora and before[1]:
            raise RuntimeError("requests counted before the run")
        return {"policy": policy, "lora": lora, "ttft_p50_ms": 1e3 * pct(ttfts, 0.5),
                "ttft_p90_ms": 1e3 * pct(ttfts, 0.9), "resident_share": share if lora else None, "counted": n}
    finally:
        for p in procs:
            stop_process(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second (Poisson)")
    ap.add_argument("--osl", type=int, default=16)
    ap.add_argument("--sim-speed", type=float, default=1.0)
    ap.add_argument("--lora-load", type=float, default=0.05, help="seconds a copy takes to load an adapter")
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rate, args.sim_speed = 96, 12.0, 4.0
    with tempfile.TemporaryDirectory(prefix="fleetllm-lora-bench-") as d:
        tmp = Path(d)
        adapters = [smollm2_adapter(tmp / f"a{i:02d}", seed=i) for i in range(ADAPTERS)]
        rows = [run(adapters, "kv_aware", True, args, tmp)]
        rows += [run(adapters, p, False, args, tmp) for p in ("round_robin", "least_load", "kv_aware")]
    return report(rows, args)


def report(rows: list[dict], args: argparse.Namespace) -> int:
    lora, base = rows[0], rows[1:]
    best = min(base, key=lambda r: r["ttft_p50_ms"])
    ratio = lora["ttft_p50_ms"] / best["ttft_p50_ms"]
    lines = ["| workload | policy | TTFT p50 ms | TTFT p90 ms | on a copy holding the adapter |", "|---|---|---|---|---|"]
    for r in rows:
        share = f"{r['resident_share']:.1%} of {r['counted']}" if r["lora"] else "-"
        lines.append(f"| {'32 adapters' if r['lora'] else 'base model'} | {r['policy']} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p90_ms']:.0f} | {share} |")
    lines.append(f"\nTTFT p50 with adapters / best policy without ({best['policy']}): {ratio:.2f} (goal <= 1.10); "
                 f"resident share {lora['resident_share']:.1%} (goal >= 90%).")
    text = "\n".join(lines) + "\n"
    print(text)
    cmd = "python benchmarks/lora_routing.py " + " ".join(sys.argv[1:])
    intro = (f"{ADAPTERS} LoRA adapters on {COPIES} simulated SmolLM2-135M copies (--max-loras {SLOTS}, each copy "
             f"warmed to hold 8), {args.requests} requests at {args.rate:g}/s Poisson, ~230-token prompts (a system "
             f"prompt per adapter), {args.osl} output tokens, sim speed {args.sim_speed:g}x, adapter load "
             f"{args.lora_load:g} s. Baseline: the same requests naming the base model.")
    save_run("## LoRA routing", intro, cmd, text)
    (ROOT / "results" / "lora_routing.json").write_text(json.dumps({"rows": rows, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
