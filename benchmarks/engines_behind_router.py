"""The router fronting a real llama.cpp ``llama-server`` and a fleetllm worker at once (issue 18), by hand.

One fleet per routing policy, started fresh (cold caches): ``llama-server`` (built by
``benchmarks/build_llama_server.sh``, SmolLM2-135M Q4_1, ``-np 2``, one thread, ``--metrics``) named to the router as
``llamacpp+http://...``, and a real fleetllm worker (one torch thread) either plain (native ``/kv/events``) or
publishing vLLM-format KV events over ZMQ (``--fleetllm-mode vllm-events``, fronted as ``vllm+http://...``).
Multi-turn conversations with per-session system prompts go through the router (streamed completions); reported per
policy: TTFT p50/p95, requests per engine (the router's decisions), each engine's prompt tokens served from its
cache (fleetllm: ``vllm:prefix_cache_hits`` / ``queries``; llama.cpp: ``llamacpp:prompt_tokens_cached_total`` over
cached + processed), what the router read of each engine (kind, load series, exact index blocks).

    benchmarks/build_llama_server.sh     # once (15-40 min of one core)
    python benchmarks/engines_behind_router.py [--fleetllm-mode native|vllm-events] [--sessions 6 --turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from common import admin_token, save_run  # noqa: E402
from engine_vs_peers import MODEL_ALIAS, find_llama_server, free_port, server  # noqa: E402

from fleetllm.bench.client import ClientConfig, RequestSpec, make_http_client, send_request  # noqa: E402
from fleetllm.models.loader import resolve  # noqa: E402
from fleetllm.router.backends.base import read_samples  # noqa: E402

PY = [sys.executable, "-m", "fleetllm.cli"]


def engines(stack: ExitStack, binary: Path, mode: str) -> tuple[list[str], list[str], dict[str, str]]:
    """Start llama-server and a fleetllm worker; the router's --workers specs and extra flags, and their URLs."""
    lport, fport, zport = free_port(), free_port(), free_port()
    llama = stack.enter_context(server(
        [str(binary), "-m", str(resolve(MODEL_ALIAS)), "--host", "127.0.0.1", "--port", str(lport), "-t", "1",
         "-tb", "1", "-np", "2", "-cb", "-c", "8192", "-a", MODEL_ALIAS, "--metrics"], lport, "llama-server", 300))
    worker_cmd = [*PY, "worker", "--model", MODEL_ALIAS, "--port", str(fport), "--num-threads", "1",
                  "--kv-cache-gb", "0.25", "--log-level", "warning"]
    extra: list[str] = []
    if mode == "vllm-events":
        cfg = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{zport}", "topic": "kv"})
        worker_cmd += ["--kv-events-config", cfg]
        os.environ.setdefault("PYTHONHASHSEED", "0")  # vLLM's root seed, shared by worker and router
        extra = ["--kv-events-config", cfg, "--hash-seed", os.environ["PYTHONHASHSEED"]]
    fleet = stack.enter_context(server(worker_cmd, fport, "fleetllm-worker", 600))
    kind = "vllm+" if mode == "vllm-events" else ""
    return [f"llamacpp+{llama}", f"{kind}{fleet}"], extra, {"llama.cpp": llama, "fleetllm": fleet}


def prompts(sessions: int) -> list[str]:
    return [f"You are assistant number {s}. Session {s} rules: " + " ".join(f"rule-{s}-{i} applies." for i in range(60))
            for s in range(sessions)]


async def conversations(url: str, sessions: int, turns: int, max_tokens: int) -> list[float]:
    """Every session's turns in order, two sessions at a time; the TTFT of each request."""
    cfg = ClientConfig(base_url=url, model=MODEL_ALIAS, request_timeout_s=300)
    ttft: list[float] = []
    texts = prompts(sessions)
    sem = asyncio.Semaphore(2)
    async with make_http_client(cfg, 2) as http:
        async def session(s: int) -> None:
            async with sem:
                for t in range(turns):
                    texts[s] += f"\nUser turn {t}: summarise rule-{s}-{t} in one line."
                    rec = await send_request(http, cfg, RequestSpec(max_tokens=max_tokens, prompt=texts[s]), s * 100 + t)
                    if rec.first_token_ns:
                        ttft.append((rec.first_token_ns - rec.start_ns) / 1e9)

        await asyncio.gather(*(session(s) for s in range(sessions)))
    return ttft


def cache_share(urls: dict[str, str]) -> dict[str, float]:
    """Each engine's prompt tokens served from its own cache, as a share of its prompt tokens."""
    out = {}
    for name, url in urls.items():
        m = read_samples(httpx.get(url + "/metrics", timeout=10).text)
        if name == "fleetllm":
            q, h = m.get("vllm:prefix_cache_queries_total", 0.0), m.get("vllm:prefix_cache_hits_total", 0.0)
        else:
            h = m.get("llamacpp:prompt_tokens_cached_total", 0.0)
            q = h + m.get("llamacpp:prompt_tokens_total", 0.0)
        out[name] = h / q if q else 0.0
    return out


def run_policy(binary: Path, policy: str, args: argparse.Namespace) -> dict:
    with ExitStack() as stack:
        specs, extra, urls = engines(stack, binary, args.fleetllm_mode)
        rport = free_port()
        token_args, admin = admin_token(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        router = stack.enter_context(server([*PY, "router", "--workers", ",".join(specs), "--policy", policy,
                                             "--port", str(rport), "--health-interval", "0.5", *token_args, *extra],
                                            rport, "router"))
        t0 = time.monotonic()
        while not all(w["model"] for w in httpx.get(router + "/router/state", headers=admin, timeout=5).json()["workers"]):
            if time.monotonic() - t0 > 60:
                raise RuntimeError("router never learnt the engines' models")
            time.sleep(0.5)
        start = time.monotonic()
        ttft = asyncio.run(conversations(router, args.sessions, args.turns, args.max_tokens))
        wall = time.monotonic() - start
        state = httpx.get(router + "/router/state", headers=admin, timeout=5).json()
        metrics = httpx.get(router + "/metrics?federate=0", timeout=5).text
        return {"policy": policy, "ttft": ttft, "wall_s": wall, "cache": cache_share(urls), "state": state,
                "metrics": metrics}


def report(results: list[dict]) -> str:
    lines = ["| policy | requests | TTFT p50 (s) | TTFT p95 (s) | wall (s) | llama.cpp prompt tokens from cache "
             "| fleetllm prompt tokens from cache | requests to llama.cpp / fleetllm |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = sorted(r["ttft"])
        lines.append(f"| {r['policy']} | {len(t)} | {statistics.median(t):.2f} | {t[int(0.95 * (len(t) - 1))]:.2f} "
                     f"| {r['wall_s']:.0f} | {r['cache']['llama.cpp']:.0%} | {r['cache']['fleetllm']:.0%} "
                     f"| {r['per_engine']} |")
    lines.append("")
    lines.append("What the router read of each engine (last run, at its end): " + "; ".join(
        f"{w['kind']}: running {w['running']}, waiting {w['waiting']}, KV usage {w['kv_usage']:.2f}, "
        f"KV events {'connected' if w['events_connected'] else 'none'}, exact index blocks {w['exact_blocks']}, "
        f"all index blocks {w['index_blocks']}" for w in results[-1]["state"]["workers"]))
    return "\n".join(lines) + "\n"


def per_engine(r: dict) -> str:
    """Requests the router sent to each engine (its decision counter, by worker label)."""
    sent: dict[str, float] = {}
    for family in text_string_to_metric_families(r["metrics"]):
        for sample in family.samples:
            if sample.name == "fleetllm_router_decisions_total":
                sent[sample.labels["worker"]] = sent.get(sample.labels["worker"], 0.0) + sample.value
    return " / ".join(str(int(sent.get(w["name"], 0))) for w in r["state"]["workers"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", default=None)
    p.add_argument("--fleetllm-mode", choices=("native", "vllm-events"), default="native")
    p.add_argument("--policies", default="round_robin,kv_aware")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-record", action="store_true", help="do not save the run to results/")
    args = p.parse_args(argv)
    binary = find_llama_server(args.llama_server)
    if binary is None:
        print("no llama-server: run benchmarks/build_llama_server.sh first", file=sys.stderr)
        return 2
    results = []
    for policy in args.policies.split(","):
        r = run_policy(binary, policy, args)
        r["per_engine"] = per_engine(r)
        results.append(r)
        print(policy, f"{len(r['ttft'])} requests", r["per_engine"], r["cache"], flush=True)
    text = report(results)
    print(text)
    if not args.no_record:
        save_run("## Other engines behind the router: llama.cpp's llama-server and a fleetllm worker",
                   "`benchmarks/engines_behind_router.py`: the router fronting a real `llama-server` "
                   "(`llamacpp+http://`) and a real fleetllm worker at once, fresh engines per policy "
                   "(see docs/scale-out.md (other engines)).",
                   "python benchmarks/engines_behind_router.py " + " ".join(argv or sys.argv[1:]), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
