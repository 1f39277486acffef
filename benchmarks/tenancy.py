"""Fair and prioritised serving (issue #40): a noisy neighbour, and interactive traffic under a batch job, with the
router's flow control off (requests go to the workers at once, first come first served) and on (``--flow-control``:
per-band, per-tenant weighted fair queuing at the router while the workers are saturated).

Simulated workers (``fleetllm worker --simulate``), or with ``--real`` fleetllm workers on the embedded SmolLM2 (one
thread each), a small batch (``--max-num-seqs``), behind one ``fleetllm router`` with API keys (weight 1 each),
started afresh for every phase. The fleet's capacity (a closed loop well past its batch slots) is measured first (the
higher of two measures) and again after every phase: each phase is reported beside the capacity just before and
just after it, so a slow spell of a shared host shows as a capacity change rather than as a latency ratio, and a
fair share is computed against the capacity beside its own phase. Tenant B's rate stays that of the first measure
(or ``--capacity``), so its phases compare. Then:

- **noisy neighbour**: tenant B streams at ``--b-load`` of the capacity (Poisson arrivals, ``--b-requests``
  requests), alone and while tenant A floods (a closed loop holding ``--flood-x`` times the fleet's batch slots in
  flight, from a client process of its own: two tenants are two clients, and in one event loop the flood's ~500
  events a second delayed B's own reading of its first token). Reported: B's TTFT p50/p90/p99, and A's output
  tokens/s against its fair share (what B leaves).
- **interactive vs batch**: the same interactive stream alone, and while a Batch API job (lines at the batch
  priority, ``--batch-concurrency`` in flight) fills the fleet. Reported: interactive TTFT p50/p99, and the batch's
  output tokens/s against the capacity the interactive traffic leaves.

The workers run ``--scheduling-policy priority`` in every phase, so "off" already has the engine's priority order.

    python benchmarks/tenancy.py                      # both benchmarks, flow control off and on
    python benchmarks/tenancy.py --runs noisy --record
    python benchmarks/tenancy.py --real --flow on --flow-flag=--flow-headroom --flow-flag=0.125
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import free_ports, save_run, stop_process, wait_healthy  # noqa: E402

from fleetllm.router.keys import KeyStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "fleetllm.cli"]
PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # ~60 tokens


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(CLI + args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)  # to the first chunk with a choice (the first token's)
    text_ttft: list[float] = field(default_factory=list)  # to the first chunk with text (a character may take 3)
    tokens: int = 0
    failed: int = 0
    why: list[str] = field(default_factory=list)  # each failure's status and body, or the client's error


def body(max_tokens: int) -> dict:
    return {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


async def stream_one(client: httpx.AsyncClient, url: str, key: str, max_tokens: int, out: Result) -> None:
    """One streamed completion: its time to the first token and its output tokens, into ``out``.

    The first token is the first chunk with a choice, as vLLM's benchmark times it: its text may be empty (a
    character split over several tokens waits for its last byte), and the first chunk with text is timed apart."""
    t0 = time.perf_counter()
    first = text = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body(max_tokens),
                                 headers={"authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                out.why.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                out.failed += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                try:
                    event = json.loads(line[6:])
                except ValueError:  # a line split at a Unicode line break inside generated text (httpx splits there)
                    continue
                if first is None and event.get("choices"):
                    first = time.perf_counter() - t0
                if text is None and event.get("choices") and event["choices"][0].get("text"):
                    text = time.perf_counter() - t0
                if event.get("usage"):
                    out.tokens += event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        out.why.append(f"{type(e).__name__}: {e}")
        out.failed += 1
        return
    if first is not None:
        out.ttft.append(first)
    if text is not None:
        out.text_ttft.append(text)


async def open_loop(client: httpx.AsyncClient, url: str, key: str, rate: float, n: int, max_tokens: int) -> Result:
    """``n`` requests at Poisson arrivals of ``rate`` per second."""
    out, rng, tasks = Result(), random.Random(7), []
    t = time.perf_counter()
    for _ in range(n):
        tasks.append(asyncio.create_task(stream_one(client, url, key, max_tokens, out)))
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
    await asyncio.gather(*tasks)
    return out


async def closed_loop(client: httpx.AsyncClient, url: str, key: str, concurrency: int, max_tokens: int,
                      stop: asyncio.Event, out: Result) -> Result:
    """``concurrency`` streams, each sending its next request when the last ends, until ``stop`` (into ``out``,
    which the caller may read while it runs)."""

    async def one() -> None:
        while not stop.is_set():
            await stream_one(client, url, key, max_tokens, out)

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Fleet:
    """The workers (started once: simulated, or ``--real`` fleetllm workers on the embedded model, one thread
    each) and a fresh router per phase."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        store = KeyStore(tmp / "keys.yaml")
        self.keys = {name: store.create(name)[1] for name in ("A", "B", "batch", "probe")}
        self.keys_file = store.path
        port = free_ports(args.workers)
        self.workers = [f"http://127.0.0.1:{port + i}" for i in range(args.workers)]
        engine = ["--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", "priority", "--log-level", "warning",
                  *args.worker_flag]
        if args.real:
            self.procs = [start(["worker", "--model", "smollm2-135m", "--num-threads", "1", "--port", str(port + i),
                                 *engine], tmp / f"worker-{i}.log") for i in range(args.workers)]
        else:
            self.procs = [start(["worker", "--simulate", "--count", str(args.workers), "--port", str(port),
                                 "--sim-speed", str(args.sim_speed), *engine], tmp / "worker-0.log")]
        for i, w in enumerate(self.workers):
            j = i if args.real else 0
            wait_healthy(w + "/ready", self.procs[j], tmp / f"worker-{j}.log", 300)
        self.phase = 0

    def router(self, flow: bool) -> tuple[str, subprocess.Popen[bytes]]:
        self.phase += 1
        port = free_ports(1)
        url, log = f"http://127.0.0.1:{port}", self.tmp / f"router-{self.phase}.log"
        flags = ["router", "--workers", ",".join(self.workers), "--policy", self.args.policy, "--port", str(port),
                 "--keys-file", str(self.keys_file), "--batch-dir", str(self.tmp / f"batches-{self.phase}"),
                 "--batch-concurrency", str(self.args.batch_concurrency), "--log-level", "warning"]
        proc = start(flags + (["--flow-control", *self.args.flow_flag] if flow else []), log)
        wait_healthy(url + "/health", proc, log, 120)
        time.sleep(1.5)  # the workers' event streams connected
        return url, proc

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p)


async def capacity(fleet: Fleet, seconds: float) -> tuple[float, float]:
    """(requests/s, output tokens/s) of the fleet under a closed loop at 4x its batch slots (flow control off)."""
    url, proc = fleet.router(False)
    try:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as client:
            stop, out = asyncio.Event(), Result()
            slots = fleet.args.workers * fleet.args.max_num_seqs
            task = asyncio.create_task(closed_loop(client, url, fleet.keys["probe"], 4 * slots,
                                                   fleet.args.max_tokens, stop, out))
            await asyncio.sleep(seconds / 3)  # ramp
            t0, before = time.perf_counter(), out.tokens
            await asyncio.sleep(seconds)
            tok_s = (out.tokens - before) / (time.perf_counter() - t0)
            stop.set()
            await task
    finally:
        stop_process(proc)
    return tok_s / fleet.args.max_tokens, tok_s


@dataclass
class Window:
    """An interactive stream measured while something else may run: its result, its seconds, and the output
    tokens/s of the other work (the flood, the batch job) meanwhile."""

    result: Result
    seconds: float
    others_tok_s: float = 0.0

    @property
    def fleet_tok_s(self) -> float:
        """Every tenant's output tokens/s over the window."""
        return self.others_tok_s + self.result.tokens / self.seconds


async def interactive(client: httpx.AsyncClient, url: str, fleet: Fleet, rate: float,
                      others: Callable[[], Awaitable[float]] | None = None) -> Window:
    """Tenant B's stream of ``--b-requests`` requests at ``rate``; ``others`` reads the other work's output tokens
    so far (at the window's start and end)."""
    t0, before = time.perf_counter(), await others() if others else 0.0
    result = await open_loop(client, url, fleet.keys["B"], rate, fleet.args.b_requests, fleet.args.max_tokens)
    seconds = time.perf_counter() - t0
    done = await others() if others else 0.0
    return Window(result, seconds, (done - before) / seconds)


STEADY = 0.10  # capacity measures this close (relative) count as one host state: phases beside them compare
# a saturated phase whose fleet output fell below this share of the capacity beside it had a slow spell within it
# (flow control's headroom and the displaced requests' recomputation cost ~10%)
BUSY_FLOOR = 0.8


@dataclass
class Beside:
    """The fleet's capacity (requests/s, output tokens/s) measured just before and just after a phase, and the
    host's 1-minute load average at the phase's start and end."""

    before: tuple[float, float]
    after: tuple[float, float]
    load: tuple[float, float]

    @property
    def tok_s(self) -> float:
        """The capacity during the phase, as output tokens/s: the mean of the two measures."""
        return (self.before[1] + self.after[1]) / 2

    @property
    def req_s(self) -> float:
        return (self.before[0] + self.after[0]) / 2

    def steady(self) -> bool:
        """Whether the capacity held within ``STEADY`` across the phase."""
        lo, hi = sorted((self.before[0], self.after[0]))
        return hi <= lo * (1 + STEADY)

    def cells(self) -> str:
        return (f"{self.before[0]:.1f} → {self.after[0]:.1f} | "
                f"{self.load[0]:.1f} → {self.load[1]:.1f}")


def flood_process(url: str, key: str, concurrency: int, max_tokens: int, tokens: Any, stop: Any) -> None:
    """Tenant A's client, a process of its own (another tenant's load generator, not B's): a closed loop of
    ``concurrency`` streams until ``stop`` is set, its output tokens kept in ``tokens`` (a shared integer)."""

    async def main() -> None:
        done, out = asyncio.Event(), Result()

        async def report() -> None:
            while not stop.is_set():
                tokens.value = out.tokens
                await asyncio.sleep(0.05)
            tokens.value = out.tokens
            done.set()

        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000)) as client:
            await asyncio.gather(report(), closed_loop(client, url, key, concurrency, max_tokens, done, out))
            tokens.value = out.tokens

    asyncio.run(main())


async def noisy(fleet: Fleet, flow: bool, flood: bool, rate: float) -> Window:
    """B alone (at ``rate``), or beside A's flood (``others_tok_s``: A's output tokens/s). A's client runs in a
    process of its own (``--flood-in-process``: in B's event loop, whose lag then adds to B's measured TTFT)."""
    args = fleet.args
    url, proc = fleet.router(flow)
    ctx = multiprocessing.get_context("spawn")
    tokens, stop_a = ctx.Value("q", 0), ctx.Event()
    flooder = None
    try:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000)) as client:
            stop, a = asyncio.Event(), Result()
            slots = args.workers * args.max_num_seqs
            flooding = None
            if flood and args.flood_in_process:
                flooding = asyncio.create_task(closed_loop(client, url, fleet.keys["A"], args.flood_x * slots,
                                                           args.max_tokens, stop, a))
            elif flood:
                flooder = ctx.Process(target=flood_process, args=(url, fleet.keys["A"], args.flood_x * slots,
                                                                  args.max_tokens, tokens, stop_a))
                flooder.start()
            if flood:
                await asyncio.sleep(3.0)  # the flood fills the fleet first

            async def a_tokens() -> float:
                return float(a.tokens if flooding is not None else tokens.value)

            w = await interactive(client, url, fleet, rate, a_tokens if flood else None)
            if w.result.why:
                print(f"B's failures ({'A flooding' if flood else 'alone'}): {w.result.why[:5]}", file=sys.stderr)
            stop.set()
            stop_a.set()
            if flooding is not None:
                await flooding
    finally:
        if flooder is not None:
            stop_a.set()
            flooder.join(60)
            if flooder.is_alive():
                flooder.kill()
        stop_process(proc)
    return w


def noisy_row(flow: bool, flood: bool, w: Window, beside: Beside) -> str:
    """One table row: B's TTFT, and A's output tokens/s against its fair share (the capacity beside the phase,
    less B's output)."""
    b = w.result
    fair = beside.tok_s - b.tokens / w.seconds
    share = f"{w.others_tok_s:.0f} / {fair:.0f} = {w.others_tok_s / fair:.2f}" if flood else "-"
    return (f"| {'on' if flow else 'off'} | {'A floods' if flood else 'B alone'} | {len(b.ttft)} | "
            f"{1e3 * pct(b.ttft, 0.5):.0f} | {1e3 * pct(b.ttft, 0.9):.0f} | {1e3 * pct(b.ttft, 0.99):.0f} | "
            f"{b.failed} | {share} | {beside.cells()} |")


async def submit_batch(client: httpx.AsyncClient, url: str, key: str, lines: int, max_tokens: int) -> str:
    """A Batch API job of ``lines`` completions; its id."""
    rows = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": max_tokens}})
            for i in range(lines)]
    auth = {"authorization": f"Bearer {key}"}
    f = await client.post(url + "/v1/files", headers=auth, data={"purpose": "batch"},
                          files={"file": ("batch.jsonl", "\n".join(rows).encode(), "application/jsonl")})
    f.raise_for_status()
    b = await client.post(url + "/v1/batches", headers=auth, json={"input_file_id": f.json()["id"],
                                                                   "endpoint": "/v1/completions",
                                                                   "completion_window": "24h"})
    b.raise_for_status()
    return b.json()["id"]


async def with_batch(fleet: Fleet, flow: bool, batch: bool, rate: float) -> Window:
    """The interactive stream (at ``rate``) alone, or beside a Batch API job (``others_tok_s``: the batch's output
    tokens/s)."""
    args = fleet.args
    url, proc = fleet.router(flow)
    try:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000)) as client:
            auth = {"authorization": f"Bearer {fleet.keys['batch']}"}
            if batch:
                lines = int(rate / args.b_load * (args.b_requests / rate + 30) * 1.5)
                batch_id = await submit_batch(client, url, fleet.keys["batch"], lines, args.max_tokens)
                await asyncio.sleep(5.0)  # the batch fills the fleet first

            async def batch_tokens() -> float:
                got = await client.get(url + f"/v1/batches/{batch_id}", headers=auth)
                return float(got.json()["request_counts"]["completed"] * args.max_tokens)

            w = await interactive(client, url, fleet, rate, batch_tokens if batch else None)
            if batch:
                await client.post(url + f"/v1/batches/{batch_id}/cancel", headers=auth)
    finally:
        stop_process(proc)
    return w


def batch_row(flow: bool, batch: bool, w: Window, beside: Beside) -> str:
    """One table row: the interactive TTFT, and the batch's output tokens/s against the capacity beside the phase
    that the interactive traffic leaves."""
    r = w.result
    left = beside.tok_s - r.tokens / w.seconds
    used = f"{w.others_tok_s:.0f} / {left:.0f} = {w.others_tok_s / left:.2f}" if batch else "-"
    return (f"| {'on' if flow else 'off'} | {'batch job' if batch else 'alone'} | {len(r.ttft)} | "
            f"{1e3 * pct(r.ttft, 0.5):.0f} | {1e3 * pct(r.ttft, 0.99):.0f} | {r.failed} | {used} | "
            f"{beside.cells()} |")


def ratio_line(kind: str, flow: bool, alone: tuple[Window, Beside], busy: tuple[Window, Beside]) -> str:
    """The goal's ratio (B's TTFT p90 under the flood, or the interactive p99 beside the batch, over its value
    alone) and how far the capacity beside the two phases moved."""
    q, what = (0.9, "B TTFT p90") if kind == "noisy" else (0.99, "interactive TTFT p99")
    ratio = pct(busy[0].result.ttft, q) / pct(alone[0].result.ttft, q)
    text = pct(busy[0].result.text_ttft, q) / pct(alone[0].result.text_ttft, q)
    drift = busy[1].req_s / alone[1].req_s - 1
    busy_share = busy[0].fleet_tok_s / busy[1].tok_s
    comparable = alone[1].steady() and busy[1].steady() and abs(drift) <= STEADY and busy_share >= BUSY_FLOOR
    return (f"flow {'on' if flow else 'off'}: {what} {ratio:.2f}x its value alone (to the first text: "
            f"{1e3 * pct(alone[0].result.text_ttft, q):.0f} -> {1e3 * pct(busy[0].result.text_ttft, q):.0f} ms, "
            f"{text:.2f}x); capacity beside the phases "
            f"{alone[1].req_s:.1f} and {busy[1].req_s:.1f} requests/s ({100 * drift:+.0f}%), the fleet's output "
            f"while busy {busy_share:.2f} of the capacity beside it: "
            f"{'comparable' if comparable else 'NOT comparable (capacity moved or the busy phase ran slow)'}")


BESIDE = "capacity req/s before → after | load"
NOISY_HEAD = ("| flow control | phase | B requests | B TTFT p50 ms | p90 ms | p99 ms | B failed | A tok/s / its fair "
              f"share | {BESIDE} |\n|---|---|---:|---:|---:|---:|---:|---|---|---|\n")
BATCH_HEAD = ("| flow control | phase | interactive requests | TTFT p50 ms | p99 ms | failed | batch tok/s / capacity "
              f"left | {BESIDE} |\n|---|---|---:|---:|---:|---:|---|---|---|\n")
PHASES = {"noisy": (NOISY_HEAD, noisy, noisy_row), "batch": (BATCH_HEAD, with_batch, batch_row)}


async def run(fleet: Fleet, runs: list[str]) -> str:
    args = fleet.args
    # B's rate is set once from the first measure: the higher of two, as a slow spell of the host lowers one
    cap = max([await capacity(fleet, args.capacity_s) for _ in range(2)])
    print(f"capacity: {cap[0]:.1f} requests/s, {cap[1]:.0f} output tokens/s", flush=True)
    out = [f"Capacity (closed loop at 4x the batch slots, flow control off), first measure (the higher of two): "
           f"{cap[0]:.1f} requests/s, {cap[1]:.0f} output tokens/s; measured again after every phase.\n"]
    rate = args.b_load * (args.capacity or cap[0])
    out[0] += f"B's rate: {rate:.2f} requests/s ({args.b_load:g} of {args.capacity or cap[0]:.1f}).\n"
    for kind in (k for k in PHASES if k in runs):
        head, phase, row = PHASES[kind]
        rows, ratios = [], []
        for flow in [f == "on" for f in args.flow.split(",")]:
            done = []
            for busy in (False, True):
                # the client's own heap out of its collector's view (a full collection of it stopped this event
                # loop for 80 ms, which B's TTFT would count): what is garbage now goes first
                gc.collect()
                gc.freeze()
                load = os.getloadavg()[0]
                w = await phase(fleet, flow, busy, rate)
                load = (load, os.getloadavg()[0])
                after = await capacity(fleet, args.capacity_s)
                done.append((w, Beside(cap, after, load)))
                cap = after
                rows.append(row(flow, busy, *done[-1]))
                print(rows[-1], flush=True)
            ratios.append(ratio_line(kind, flow, *done))
            print(ratios[-1], flush=True)
        out.append(head + "\n".join(rows) + "\n\n" + "\n".join(ratios) + "\n")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="noisy,batch", help="comma-separated: noisy, batch")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--real", action="store_true", help="fleetllm workers on the embedded SmolLM2 (one thread each) "
                    "instead of simulated ones")
    ap.add_argument("--flow", default="off,on", help="comma-separated: off, on (the router's --flow-control)")
    ap.add_argument("--policy", default="least_load", help="the router's --policy")
    ap.add_argument("--flow-flag", action="append", default=[], metavar="ARG",
                    help="one more router argument with flow control on (repeat: --flow-flag=--flow-headroom "
                    "--flow-flag=0.2)")
    ap.add_argument("--flood-in-process", action="store_true",
                    help="tenant A's client in B's event loop (before 2026-12-06: its lag then adds to B's TTFT)")
    ap.add_argument("--worker-flag", action="append", default=[], metavar="ARG",
                    help="one more worker argument (repeat; e.g. --worker-flag=--no-step-pause)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="each simulated worker's batch slots")
    ap.add_argument("--sim-speed", type=float, default=4.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--b-load", type=float, default=0.25, help="B's rate as a fraction of the capacity")
    ap.add_argument("--b-requests", type=int, default=300)
    ap.add_argument("--flood-x", type=int, default=5, help="A's requests in flight, in multiples of the batch slots")
    ap.add_argument("--batch-concurrency", type=int, default=64, help="the router's --batch-concurrency")
    ap.add_argument("--capacity-s", type=float, default=15.0)
    ap.add_argument("--capacity", type=float, default=0.0, metavar="REQ_S",
                    help="the capacity B's rate is a share of (default: the first measure; a host busy at the start "
                    "lowers that one, the measures beside the phases check the value given)")
    ap.add_argument("--record", action="store_true", help="write results/<section>.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleetllm-tenancy-") as tmp:
        fleet = Fleet(args, Path(tmp))
        try:
            lines = asyncio.run(run(fleet, args.runs.split(",")))
        finally:
            fleet.stop()
            for log in sorted(Path(tmp).glob("*.log")):  # the processes' errors, before their folder goes
                errors = [ln for ln in log.read_text(errors="replace").splitlines() if "ERROR" in ln or "Traceback" in ln]
                if errors:
                    print(f"{log.name}: {len(errors)} error lines, the first: {errors[0][:300]}", file=sys.stderr)
    print(lines)
    if args.record:
        kind = "real workers (SmolLM2, one thread each" if args.real else f"simulated workers (--sim-speed {args.sim_speed:g}"
        save_run("## Fair and prioritised serving", f"{args.workers} {kind}, --max-num-seqs "
                 f"{args.max_num_seqs}, priority scheduling), one router per phase "
                 f"(flow control flags: --flow-control {' '.join(args.flow_flag)}) "
                 f"({args.policy}, API keys of weight 1); {args.max_tokens}-token completions of a ~60-token prompt; B "
                 f"at {args.b_load:g} of the capacity, A holding {args.flood_x}x the batch slots in flight; the batch "
                 f"job through the Batch API at --batch-concurrency {args.batch_concurrency}.", " ".join(sys.argv),
                 lines)


if __name__ == "__main__":
    main()
