"""The workers as the router sees them: health, load counted at dispatch, circuit breaker, KV events.

Load is counted the moment a request is dispatched (not when its first byte comes back), so a burst
of arrivals spreads instead of piling onto the worker that looked idle a moment ago. Each worker has
two background tasks: a readiness check (``/ready``: a worker that is alive but warming up or draining
gets no requests; ``/health`` for upstreams without ``/ready``), and a subscription to its ``/kv/events`` stream that keeps the
exact prefix index and the worker-reported load (running, waiting, queued prefill tokens, KV usage)
current. The router listens only once every worker's first check has answered (or timed out). A worker whose
health check fails is out of rotation and its index entries are dropped at once; when it comes back
(possibly restarted, with an empty cache) the event stream's snapshot re-syncs the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from fleetllm.router.backends import detect
from fleetllm.router.backends.watch import watch_engine
from fleetllm.router.index import PrefixIndex
from fleetllm.router.pipeline.held_average import TimeAverage
from fleetllm.server.worker_secret import CHALLENGE

log = logging.getLogger(__name__)


@dataclass
class Breaker:
    """Circuit breaker: after ``threshold`` consecutive failures the worker gets no requests for
    ``cooldown_s``; then one probe request decides (success closes, failure re-opens)."""

    threshold: int = 3
    cooldown_s: float = 5.0
    failures: int = 0
    state: str = "closed"  # closed | open | half_open
    open_until: float = 0.0
    trips: int = 0
    probe_in_flight: bool = False

    def allows(self, now: float) -> bool:
        if self.state == "open" and now >= self.open_until:
            self.state, self.probe_in_flight = "half_open", False
        if self.state == "closed":
            return True
        return self.state == "half_open" and not self.probe_in_flight

    def on_dispatch(self) -> None:
        if self.state == "half_open":
            self.probe_in_flight = True

    def busy(self) -> None:
        """The worker answered but had no room (503): neither a failure nor a success; a half-open
        breaker may send its probe again."""
        self.probe_in_flight = False

    def success(self) -> None:
        self.failures, self.state, self.probe_in_flight = 0, "closed", False

    def failure(self, now: float) -> bool:
        """Count a failure; True if this opened the breaker."""
        self.failures += 1
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.threshold):
            self.state, self.open_until, self.probe_in_flight = "open", now + self.cooldown_s, False
            self.trips += 1
            return True
        return False


@dataclass
class WorkerState:
    """One upstream worker. Router-side counters change only on the event loop (no locks)."""

    name: str
    url: str
    zone: str = ""
    role: str = "both"  # prefill | decode | both; the worker's KV-event snapshot says which
    healthy: bool = False
    # counted by the router at dispatch
    inflight: int = 0
    pending_prefill_tokens: int = 0  # uncached prompt tokens of requests still waiting for a first byte
    decoding: int = 0  # requests streaming tokens
    inflight_tokens: int = 0  # the prompt tokens (whole contexts) of this router's requests in flight there
    # those two counts averaged over time (the routing cost's load window; noted at each change, by the forwarder)
    streams_avg: TimeAverage = field(default_factory=TimeAverage)
    tokens_avg: TimeAverage = field(default_factory=TimeAverage)
    # reported by the worker (KV events stream)
    running: int = 0
    waiting: int = 0
    sent_since_report: int = 0  # requests this router dispatched since the worker's last load report
    ended_since_report: int = 0  # and of its requests there, those that ended since (each freed a batch slot)
    others: int = 0  # other routers' requests it held at its last load report (see load_report)
    # the most of this router's requests in flight there since the last report, and in the window before it
    inflight_peak: tuple[int, int] = (0, 0)
    queued_prefill_tokens: int = 0  # prompt tokens not yet computed of its waiting and prefilling requests
    kv_usage: float = 0.0
    tier_load_s: dict[str, float] = field(default_factory=dict)  # its KV tiers' measured seconds a block, by medium
    model: str | None = None
    variant: str = ""  # which of its model's variants (canary, stable, ...) this copy runs; "" when unsplit
    block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int | None = None  # its batch slots (a fleetllm worker's snapshot says): what it can start now
    # its snapshot's --scheduling-policy: "priority" gives a more urgent request the slot of a less urgent one
    scheduling_policy: str | None = None
    bulk_inflight: int = 0  # of this router's requests in flight there, those released as bulk work (flow control)
    instance: str | None = None
    events_connected: bool = False
    health_failures: int = 0
    lost: int = 0  # times it was taken out of rotation for not answering health checks at all
    draining: bool = False  # being removed: no new requests, in-flight ones finish
    breaker: Breaker = field(default_factory=Breaker)
    # the engine behind it (fleetllm/router/backends): None until a plain URL shows what it serves
    kind: str | None = None
    hash_scheme: str = ""  # whose block hashes key its index entries: "" fleetllm's, else a VllmHasher.key
    kv_source: Any = None  # a vLLM worker's KV-event source (backends.vllm_events.EventSource)
    reports_kv: bool = True  # False: no KV events, routed prefixes are remembered longer instead
    # LoRA adapters (fleetllm/router/adapters.py): every one it serves, and those a request runs with at once
    adapters: frozenset[str] = frozenset()
    resident_adapters: frozenset[str] = frozenset()

    def routable(self, now: float) -> bool:
        return self.healthy and not self.draining and self.breaker.allows(now)

    def dispatched(self) -> None:
        """One more of this router's requests is in flight here."""
        self.inflight += 1
        self.sent_since_report += 1
        self.inflight_peak = (self.inflight_peak[0], max(self.inflight_peak[1], self.inflight))

    def load_report(self, running: int, waiting: int) -> None:
        """The worker's load report (it runs ``running`` requests and holds ``waiting``): those of other routers
        are what it reports beyond this router's own requests there.

        This router's own count (:attr:`inflight`, from dispatch to the end of the relayed answer) is exact and
        current; a report is up to a poll old when it arrives and may still count requests this router has seen
        end since (or miss ones it sent since). So the report is trusted only for what this router cannot count:
        its own requests there when the report was taken are at most the most it had in flight over the last two
        report windows, and the rest, if any, are other routers'. Alone, ``others`` stays 0 however late a report
        comes (a stale one cannot hold slots that are free); beside other routers it is a lower bound, refreshed
        at every report."""
        mine = max(*self.inflight_peak, self.inflight)
        self.others = max(0, running + waiting - mine)
        self.inflight_peak = (self.inflight_peak[1], self.inflight)
        self.running, self.waiting = running, waiting
        self.sent_since_report = self.ended_since_report = 0


class WorkerMonitor:
    """Runs the health check and KV-event subscription of every worker."""

    def __init__(self, workers: list[WorkerState], index: PrefixIndex, client: httpx.AsyncClient,
                 health_interval_s: float = 1.0, health_timeout_s: float = 2.0, failures_to_down: int = 2,
                 on_change: Callable[[WorkerState], None] | None = None) -> None:
        self.workers = workers
        self.index = index
        self.client = client
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.failures_to_down = failures_to_down
        self.on_change = on_change or (lambda w: None)
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self.subscribers: dict[str, Any] = {}  # vLLM workers' KV-event subscribers, by worker name
        self.stopping = False

    async def start(self) -> None:
        """Watch every worker; return once each has answered its first readiness check, or after one check's
        timeout (a check still unanswered then goes on in the background).

        The router's lifespan awaits this before its server listens: a router that took requests before its
        first round of checks came back answered them 503 "no healthy worker" while its whole fleet was up
        (every worker starts out of rotation until a check says it is ready)."""
        first = [self.watch(w) for w in self.workers]
        if first:
            await asyncio.wait(first, timeout=self.health_timeout_s)

    def watch(self, w: WorkerState) -> asyncio.Task[bool]:
        """Start ``w``'s health checks and KV-event subscription (also for a worker added later); the task of its
        first check."""
        first = asyncio.create_task(self.check(w), name=f"first-check-{w.name}")
        self._tasks[w.name] = [first, asyncio.create_task(self._health_loop(w, first), name=f"health-{w.name}"),
                               asyncio.create_task(self._engine_loop(w), name=f"events-{w.name}")]
        return first

    async def unwatch(self, w: WorkerState) -> None:
        """Stop watching a removed worker and forget what it had cached."""
        await _cancel(self._tasks.pop(w.name, []))
        self.index.drop(w.name)

    async def stop(self) -> None:
        self.stopping = True
        await _cancel([t for ts in self._tasks.values() for t in ts])

    def mark_down(self, w: WorkerState, why: str) -> None:
        """Take a worker out of rotation now and forget what it had cached."""
        if w.healthy:
            log.warning("worker %s down: %s", w.name, why)
        w.healthy = False
        self.index.drop(w.name)
        if w.name in self.subscribers:
            self.subscribers[w.name].forget()  # its entries come back from the worker's replay buffer
        self.on_change(w)

    async def check(self, w: WorkerState) -> bool:
        """One readiness check; a worker that answers "not ready" is out of rotation at once."""
        not_ready = unanswered = False
        try:
            r = await self.client.get(w.url + "/ready", timeout=self.health_timeout_s)
            if r.status_code == 404:  # an upstream with no readiness probe (another server): liveness it is
                r = await self.client.get(w.url + "/health", timeout=self.health_timeout_s)
            ok, not_ready = r.status_code == 200, r.status_code == 503
        except httpx.HTTPError:
            ok, unanswered = False, True
        if not_ready and w.healthy:
            w.health_failures = self.failures_to_down
            self.mark_down(w, f"not ready ({r.text[:80]})")
            return False
        if ok:
            w.health_failures = 0
            if not w.healthy:
                log.info("worker %s healthy", w.name)
                w.healthy = True
                w.breaker.success()  # back (often a new process): failures from before it went down are moot
                self.on_change(w)
        else:
            w.health_failures += 1
            if w.health_failures >= self.failures_to_down:
                if unanswered and w.healthy:
                    w.lost += 1  # its requests still waiting for a first byte go elsewhere (forward.py)
                self.mark_down(w, "health check failed")
        return ok

    async def _health_loop(self, w: WorkerState, first: asyncio.Task[bool]) -> None:
        """A check every health interval after the ``first``."""
        await first
        while not self.stopping:
            await asyncio.sleep(self.health_interval_s)
            await self.check(w)

    async def _engine_loop(self, w: WorkerState) -> None:
        """A fleetllm worker's event stream; another engine's load poll (and its vLLM-format KV events: also a
        fleetllm worker's when it publishes those)."""
        if w.kv_source is None and w.kind in (None, "fleetllm"):
            await self._events_loop(w)
        if w.kind is None:  # a plain URL without /kv/events: some other engine
            w.kind = await detect(self.client, w.url, self.health_timeout_s)
            log.info("worker %s is a %s server", w.name, w.kind)
        if not self.stopping:
            await watch_engine(self, w)

    async def _events_loop(self, w: WorkerState) -> None:
        """Follow a fleetllm worker's /kv/events; return if a plain URL's server has none (another engine)."""
        backoff = 0.2
        while not self.stopping:
            try:
                async with self.client.stream("GET", w.url + "/kv/events", timeout=httpx.Timeout(5.0, read=10.0)) as r:
                    if r.status_code in (404, 405) and w.kind is None:
                        return
                    if r.status_code == 401 and w.kind is None and _fleetllm_challenge(r):
                        w.kind = "fleetllm"  # a fleet's worker: asked again, now with the secret
                        continue
                    if r.status_code != 200:
                        raise httpx.HTTPError(f"/kv/events answered {r.status_code}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            self._apply(w, json.loads(line[6:]))
                            backoff = 0.2
            except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
                log.debug("kv events from %s: %s", w.name, e)
            # The stream broke: whatever the worker had may be gone (restart), so stop trusting it.
            if w.events_connected:
                w.events_connected = False
                self.index.drop_exact(w.name)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _apply(self, w: WorkerState, ev: dict) -> None:
        kind = ev["type"]
        if kind == "snapshot":
            w.kind = "fleetllm"
            if w.instance is not None and ev["instance"] != w.instance:
                log.info("worker %s restarted (instance %s): index re-synced", w.name, ev["instance"][:8])
                self.index.drop(w.name)
            w.instance, w.model = ev["instance"], ev["model"]
            w.block_size, w.num_blocks = ev["block_size"], ev["num_blocks"]
            w.max_num_seqs = ev.get("max_num_seqs")  # absent from older workers
            w.scheduling_policy = ev.get("scheduling_policy")
            w.role = ev.get("role", w.role)
            self.index.reset(w.name, ev["hashes"], capacity=ev["num_blocks"])
            self.index.set_scope(w.name, ev.get("kv_namespace"))  # its shared KV tier's blocks: the fleet's
            for medium, hashes in (ev.get("tiers") or {}).items():  # its KV tiers' blocks, by medium
                self.index.stored(w.name, hashes, medium)
            w.events_connected = True
        elif kind == "stored":
            self.index.stored(w.name, ev["hashes"], ev.get("medium"))  # no medium: the pool
        elif kind == "removed":
            self.index.removed(w.name, ev["hashes"], ev.get("medium"))
        elif kind == "draining":
            self.mark_down(w, "draining")
        if "adapters" in ev:  # a LoRA worker's report (fleetllm/router/adapters.py)
            w.adapters, w.resident_adapters = frozenset(ev["adapters"]), frozenset(ev.get("resident_adapters", ()))
        if "kv_usage" in ev:
            w.load_report(ev["running"], ev["waiting"])
            w.kv_usage = ev["kv_usage"]
            w.queued_prefill_tokens = ev.get("queued_prefill_tokens", 0)  # absent from older workers
            w.tier_load_s = {str(m).upper(): float(s) for m, s in (ev.get("tier_load_s") or {}).items()}



async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


def _fleetllm_challenge(r: httpx.Response) -> bool:
    """Whether a 401 is a fleet's worker asking for its fleet's secret (:data:`~fleetllm.server.worker_secret.CHALLENGE`)."""
    return r.headers.get(CHALLENGE[0].decode(), "") == CHALLENGE[1].decode()
