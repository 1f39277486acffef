"""Soak: a fleet of real workers behind the router, saturated for ``--duration`` seconds while it is hurt.

``fleetllm serve`` starts real SmolLM2 workers (one core each) and a kv_aware router. ``--clients``
closed-loop clients keep it saturated (more requests than the workers run at once, so their queues
fill and the router answers back-pressure): half streaming, half not, sharing a few system prompts
(prefix hits), a fifth of them reusing a handful of ``x-request-id`` values (duplicates in flight), and
some streams dropped by the client after a few chunks. Meanwhile one rolling restart goes through
every worker (``fleetllm fleet restart``, from another process, early in the run) and the first
worker's process is SIGKILLed every ``--kill-every`` seconds (the serve restarts it).

Checks at the end:
- no hung client: every request ends (answer, error, or the client's own drop) before ``HUNG_S``;
- no lost non-streaming request: every one is a 200 with choices or an OpenAI-style error with a status
  (a connection dropped without an answer is lost);
- KV usage back to 0 on every worker and nothing in flight at the router, once the load stops;
- RSS growth under 10%: the router, and each worker process that lived a third of the run or more after
  its first minute, from its first sample a minute into its life to its last.

    PYTHONPATH=. python benchmarks/soak.py                 # 10 minutes; saves the run to results/
    PYTHONPATH=. python benchmarks/soak.py --duration 120 --no-record
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from common import admin_token, free_ports, save_run, stop_process, tail

HUNG_S = 300.0  # a request not ended after this long is a hung client
SETTLE_S = 60.0  # RSS baselines are taken this long into a process's life (imports, arenas, caches settle)
SYSTEMS = [f"You are assistant number {i}. Answer briefly and stay on the topic the user asks about." for i in range(4)]
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)  # (kind, outcome) -> requests
    hung: int = 0
    lost: list[str] = field(default_factory=list)  # what each lost non-streaming request got
    rss: list[tuple[float, str, int, int]] = field(default_factory=list)  # t, role:port, pid, bytes
    events: list[str] = field(default_factory=list)


def fleet_yaml(port: int, workers: int) -> dict:
    machines = [{"name": f"m{i}", "cores": 1, "memory_gb": 4, "zone": f"zone-{i}"} for i in range(workers)]
    engine = {"max_num_seqs": 8, "max_waiting": 8, "kv_cache_gb": 0.25}
    model = {"source": "smollm2-135m", "replicas": workers, "engine": engine, "resources": {"cores": 1, "memory_gb": 2}}
    return {"port": port, "policy": "kv_aware", "machines": machines, "models": [model],
            "router_args": ["--health-interval", "0.5"]}


def request_body(rng: random.Random, stream: bool) -> dict:
    user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
    return {"messages": [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": user}],
            "max_tokens": rng.randint(8, 48), "stream": stream}


def _is_error_body(text: str) -> bool:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and "message" in err


async def non_streaming(client: httpx.AsyncClient, body: dict, headers: dict, out: Outcomes) -> float:
    """One request; returns how long to wait before the next (Retry-After on back-pressure)."""
    try:
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
    except httpx.HTTPError as e:
        out.counts["plain", "lost"] += 1
        out.lost.append(f"{type(e).__name__}: {e}")
        return 0.0
    if r.status_code == 200 and r.json().get("choices"):
        out.counts["plain", "ok"] += 1
    elif r.status_code >= 400 and _is_error_body(r.text):
        out.counts["plain", f"error {r.status_code}"] += 1
        return float(r.headers.get("retry-after", 0))
    else:
        out.counts["plain", "lost"] += 1
        out.lost.append(f"{r.status_code}: {r.text[:120]}")
    return 0.0


async def streaming(client: httpx.AsyncClient, body: dict, headers: dict, drop_after: int | None,
                    out: Outcomes) -> float:
    chunks, error, done = 0, False, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                out.counts["stream", f"error {r.status_code}"] += 1
                return float(r.headers.get("retry-after", 0))
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks += 1
                    error = error or '"error"' in line[:20]
                    if drop_after is not None and chunks >= drop_after:
                        out.counts["stream", "dropped by client"] += 1
                        return 0.0
    except httpx.HTTPError:
        out.counts["stream", "cut (no [DONE])"] += 1
        return 0.0
    out.counts["stream", "error event" if error else "ok" if done else "cut (no [DONE])"] += 1
    return 0.0


async def client_loop(i: int, url: str, end: float, out: Outcomes) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(HUNG_S, connect=10)) as client:
        while time.monotonic() < end:
            stream = rng.random() < 0.5
            headers = {"x-request-id": f"dup-{rng.randrange(3)}"} if rng.random() < 0.2 else {}
            drop = rng.randint(1, 4) if stream and rng.random() < 0.15 else None
            call = streaming(client, request_body(rng, True), headers, drop, out) if stream else \
                non_streaming(client, request_body(rng, False), headers, out)
            try:
                pause = await asyncio.wait_for(call, HUNG_S)
            except TimeoutError:
                out.hung += 1
                pause = 0.0
            await asyncio.sleep(pause)


def fleet_pids(serve_pid: int) -> dict[str, int]:
    """``{"router:PORT" | "worker:PORT": pid}`` of the serve's children (read from /proc: only ours)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != serve_pid or b"fleetllm.cli" not in argv or b"--port" not in argv:
            continue
        role = argv[argv.index(b"fleetllm.cli") + 1].decode()
        found[f"{role}:{argv[argv.index(b'--port') + 1].decode()}"] = int(d.name)
    return found


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def roll(args: argparse.Namespace, run_dir: Path, t0: float, out: Outcomes) -> None:
    """The rolling restart, as an operator starts it: ``fleetllm fleet restart`` from another process."""
    out.events.append(f"{time.monotonic() - t0:.0f}s rolling restart (fleetllm fleet restart)")
    r = subprocess.run([sys.executable, "-m", "fleetllm.cli", "fleet", "restart", "--port", str(args.port),
                        "--run-dir", str(run_dir)], capture_output=True, text=True)
    out.events.append(f"{time.monotonic() - t0:.0f}s rolling restart exit {r.returncode}: "
                      f"{(r.stdout + r.stderr).strip().splitlines()[-1]}")


def faults(serve: subprocess.Popen, args: argparse.Namespace, run_dir: Path, t0: float, out: Outcomes,
           stop: threading.Event) -> None:
    """The rolling restart at ``--roll-at``, a SIGKILL of the first worker every ``--kill-every`` (not while
    the roll runs, and not in the last minute), and an RSS sample of every process every 5 s."""
    victim, rolling = None, None
    next_kill, next_sample = args.kill_every, 0.0
    while not stop.wait(0.5):
        t = time.monotonic() - t0
        pids = fleet_pids(serve.pid)
        victim = victim or min((k for k in pids if k.startswith("worker:")), default=None)
        if t >= next_sample:
            out.rss += [(t, k, p, rss(p)) for k, p in pids.items()]
            next_sample += 5.0
        if rolling is None and t >= args.roll_at:
            rolling = threading.Thread(target=roll, args=(args, run_dir, t0, out), daemon=True)
            rolling.start()
        elif rolling is not None and not rolling.is_alive() and t >= next_kill and t < args.duration - 60 \
                and victim in pids:
            os.kill(pids[victim], signal.SIGKILL)
            out.events.append(f"{t:.0f}s SIGKILL {victim} (pid {pids[victim]})")
            next_kill = t + args.kill_every
    if rolling is not None:
        rolling.join()


def settle(url: str, admin: dict[str, str], timeout_s: float = 60.0) -> dict:
    """Once the load stops: wait until no request is in flight at the router and every worker's KV usage is
    0 (read from the router's federated /metrics: the workers answer only their fleet); return what was seen
    last."""
    end = time.monotonic() + timeout_s
    seen: dict = {}
    while time.monotonic() < end:
        try:
            state = httpx.get(url + "/router/state", headers=admin, timeout=5).json()
            seen = {"router inflight": sum(w.get("inflight", 0) for w in state["workers"])}
            page = httpx.get(url + "/metrics", timeout=5).text
            for w in state["workers"]:
                usage = [float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                         if line.startswith("vllm:kv_cache_usage_perc") and f'worker="{w["name"]}"' in line]
                seen[w["url"]] = usage[0] if usage else None
            if all(v == 0 for v in seen.values()):
                return seen
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    return seen


def growth(out: Outcomes, duration: float) -> list[tuple[str, int, float, float, float]]:
    """Per process instance (role:port, pid): lifetime in the run, RSS at SETTLE_S into it and at its end."""
    by_pid: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for t, key, pid, b in out.rss:
        if b:
            by_pid.setdefault((key, pid), []).append((t, b))
    rows = []
    for (key, pid), samples in by_pid.items():
        first = samples[0][0]
        settled = [s for s in samples if s[0] >= first + SETTLE_S]
        if settled:
            rows.append((key, pid, samples[-1][0] - settled[0][0], settled[0][1], samples[-1][1]))
    return rows


def report(out: Outcomes, kv: dict, rows: list, args: argparse.Namespace, load: str) -> tuple[str, bool]:
    total = sum(out.counts.values())
    lines = [f"{args.duration:.0f} s, {args.clients} clients, {args.workers} real workers; {total} requests; "
             f"load average over the run {load}", "", "| requests | outcome | count |", "|---|---|---|"]
    lines += [f"| {kind} | {what} | {n} |" for (kind, what), n in sorted(out.counts.items())]
    judged = [r for r in rows if r[2] >= args.duration / 3]
    growth_ok = all(end / start - 1 < 0.10 for _, _, _, start, end in judged)
    lost = out.counts["plain", "lost"]
    ok = out.hung == 0 and lost == 0 and all(v == 0 for v in kv.values()) and growth_ok and bool(judged)
    lines += ["", f"- hung clients: **{out.hung}**; lost non-streaming requests: **{lost}**"
                  + (f" ({'; '.join(out.lost[:5])})" if out.lost else ""),
              f"- after the load: {', '.join(f'{k} {v}' for k, v in kv.items())}",
              "- RSS (MB) from a minute into each process's life to its end (judged: a third of the run or more after that minute):"]
    lines += [f"  - {k} pid {pid}: {start / 1e6:.0f} → {end / 1e6:.0f} ({end / start - 1:+.1%}) over {life:.0f} s"
              f"{'' if (k, pid, life, start, end) in judged else ' (not judged)'}" for k, pid, life, start, end in rows]
    lines += ["- faults: " + "; ".join(out.events), f"- verdict: **{'pass' if ok else 'FAIL'}**", ""]
    return "\n".join(lines), ok


def start_fleet(args: argparse.Namespace, work: Path) -> subprocess.Popen:
    (work / "fleet.yaml").write_text(yaml.safe_dump(fleet_yaml(args.port, args.workers)))
    log = open(work / "serve.log", "wb")  # noqa: SIM115 (closed with the process)
    p = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", "serve", "--config", str(work / "fleet.yaml"),
                          "--log-dir", str(work), "--run-dir", str(work), *admin_token(work)[0]], stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    end = time.monotonic() + 600
    while "fleet ready" not in (work / "serve.log").read_text(errors="replace"):
        if p.poll() is not None or time.monotonic() > end:
            stop_process(p)
            raise RuntimeError("fleet did not start:\n" + tail(work / "serve.log"))
        time.sleep(0.5)
    return p


async def drive(url: str, args: argparse.Namespace, out: Outcomes) -> None:
    end = time.monotonic() + args.duration
    await asyncio.gather(*(client_loop(i, url, end, out) for i in range(args.clients)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2, help="real worker processes, one core each")
    ap.add_argument("--kill-every", type=float, default=120.0, help="seconds between SIGKILLs of a worker")
    ap.add_argument("--roll-at", type=float, default=30.0, help="when the rolling restart starts (s)")
    ap.add_argument("--port", type=int, default=None, help="the router's (workers take the next ones; default: free)")
    ap.add_argument("--no-record", action="store_true", help="do not save the run to results/")
    args = ap.parse_args()
    args.port = args.port or free_ports(args.workers + 1)
    work = Path(tempfile.mkdtemp(prefix="fleetllm-soak-"))
    print(f"starting the fleet (logs in {work}) ...", flush=True)
    serve = start_fleet(args, work)
    out, stop = Outcomes(), threading.Event()
    url = f"http://127.0.0.1:{args.port}"
    load0 = os.getloadavg()
    try:
        t0 = time.monotonic()
        hands = threading.Thread(target=faults, args=(serve, args, work, t0, out, stop), daemon=True)
        hands.start()
        asyncio.run(drive(url, args, out))
        stop.set()
        hands.join(600)
        kv = settle(url, admin_token(work)[1])
        out.rss += [(time.monotonic() - t0, k, p, rss(p)) for k, p in fleet_pids(serve.pid).items()]
    finally:
        stop.set()
        serve.terminate()  # the serve stops its router, then its workers (20 s grace each): wait for it
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            stop_process(serve)
    load = f"{load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} / {os.getloadavg()[1]:.1f} (1 / 5 min) at the end"
    text, ok = report(out, kv, growth(out, args.duration), args, load)
    print(text)
    if not args.no_record:
        save_run("## Soak: a saturated real fleet under faults (issue #13)",
                   "`benchmarks/soak.py`: real SmolLM2 workers behind a kv_aware router, saturated by closed-loop "
                   "clients (streaming and not, client drops, duplicate ids) through a rolling restart and a "
                   "SIGKILLed worker every 2 minutes.", "PYTHONPATH=. python " + " ".join(sys.argv), text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
