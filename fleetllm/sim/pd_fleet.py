"""P/D at fleet scale, in virtual time: is a prefill pool worth its workers, at which threshold?

A fleet of ``n`` one-core workers serves short chats and long documents (Poisson arrivals). Colocated,
every worker prefills and decodes; split, ``prefill`` of them only prefill (FCFS, one prompt at a time
each) and ship the KV to the decode workers at ``bandwidth`` bytes/s. Routing balances load, so one decode
worker is simulated as representative of all, at its share of the traffic; the prefill pool is simulated
whole. A decode worker runs the engine's step: the running requests' decode tokens plus one chunk of the
oldest waiting prompt, timed by the measured :class:`~fleetllm.sim.profile.TimingProfile`; every step is a
gap between tokens for every request decoding in it, which is how the short requests' ITL p99 is counted
(each gap, as vLLM and ``fleetllm bench`` count it). An imported prompt stalls the decode worker for the
import (counted as the whole transfer: the router's estimate does the same). The threshold is a token
count or ``auto``: the router's own decision (:class:`fleetllm.disagg.pd_auto.PdEstimate`) from the
simulated worker's state. Torch-free; a fleet of 64 for 5 virtual minutes takes well under a second.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from fleetllm.disagg.pd_auto import AUTO, ArrivalRates, PdEstimate
from fleetllm.sim.profile import TimingProfile


@dataclass(frozen=True)
class PdTraffic:
    """Requests per second per worker of the fleet, and their sizes."""

    rate_per_worker: float
    long_share: float  # fraction of requests that are long documents
    short_isl: int = 48
    short_osl: int = 64
    long_isl: tuple[int, int] = (500, 3000)  # uniform between
    long_osl: int = 8


@dataclass
class PdResult:
    short_itl_p99_ms: float
    short_itl_p50_ms: float
    long_ttft_p90_ms: float
    short_ttft_p90_ms: float
    remote_share: float  # of the long prompts, the share prefilled on the prefill pool
    saturated: bool  # a queue kept growing: the fleet does not keep up with this traffic


@dataclass
class _Req:
    arrival: float
    isl: int
    osl: int
    short: bool
    mine: bool = True  # a long document of another decode worker only occupies the prefill pool
    todo: int = 0  # prompt tokens still to compute here
    first: float | None = None
    done_tokens: int = 0


@dataclass
class _Worker:
    """One decode (or colocated) worker: FCFS waiting prompts, a batch of decoding requests."""

    profile: TimingProfile
    max_batch: int = 8
    chunk: int = 256
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    stall_s: float = 0.0  # imports to absorb before the next step

    def step(self, now: float, gaps: list[float], ttfts: tuple[list, list]) -> float:
        """Run one step from ``now``; returns when it ends (``now`` itself if idle)."""
        chunk, head = 0, None
        if self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            chunk = min(self.chunk, head.todo)
        if not self.running and not chunk and not self.stall_s:
            return now
        ctx = sum(r.isl + r.done_tokens for r in self.running)
        dt = self.profile.step_seconds(len(self.running), chunk, ctx) + self.stall_s
        self.stall_s, end = 0.0, now + dt
        for r in self.running:
            if r.short:
                gaps.append(dt)
            r.done_tokens += 1
        self.running = [r for r in self.running if r.done_tokens < r.osl]
        if head is not None:
            head.todo -= chunk
            if head.todo <= 0:
                self.waiting.popleft()
                head.first = end
                (ttfts[0] if head.short else ttfts[1]).append(end - head.arrival)
                head.done_tokens = 1
                if head.osl > 1:
                    self.running.append(head)
        return end

    def queued_tokens(self) -> int:
        return sum(r.todo for r in self.waiting)


def simulate_pd(profile: TimingProfile, traffic: PdTraffic, workers: int, prefill: int, threshold: int | str,
                bytes_per_token: float, bandwidth: float, seconds: float = 300.0, seed: int = 0) -> PdResult:
    """Short ITL and both TTFTs of a fleet of ``workers``, ``prefill`` of them a prefill pool."""
    rng = random.Random(seed)
    decode = workers - prefill
    rate_s = traffic.rate_per_worker * workers * (1 - traffic.long_share) / decode  # per decode worker
    rate_l = traffic.rate_per_worker * workers * traffic.long_share  # whole fleet
    w = _Worker(profile)
    prefill_rate = max(profile.prefill)[0] / max(profile.prefill)[1]
    arrivals = _arrivals(rng, traffic, rate_s, rate_l, seconds, 1 / decode)
    pool = [0.0] * prefill  # when each prefill worker of the fleet is next free
    landing: list[tuple[float, int, _Req]] = []  # (KV arrives at the decode worker, order, request)
    gaps: list[float] = []
    ttfts: tuple[list[float], list[float]] = ([], [])
    now, i, remote, longs = 0.0, 0, 0, 0
    seen = ArrivalRates()  # what the router measures of the simulated decode worker
    while now < seconds:
        while i < len(arrivals) and arrivals[i].arrival <= now:
            r = arrivals[i]
            i += 1
            arriving = seen.rate("d", now)  # before this request, as the router reads it
            if r.mine:
                seen.observe("d", r.arrival)
            if not r.short:
                longs += r.mine
                if prefill and _goes_remote(r, w, pool, now, threshold, prefill_rate, bytes_per_token, bandwidth,
                                            arriving):
                    remote += r.mine
                    k = min(range(prefill), key=pool.__getitem__)
                    pool[k] = max(pool[k], now) + profile.step_seconds(0, r.isl)
                    if r.mine:
                        heapq.heappush(landing, (pool[k] + r.isl * bytes_per_token / bandwidth, i, r))
                    continue
            if not r.mine:
                continue  # prefilled on its own decode worker, another one than the one simulated
            r.todo = r.isl
            w.waiting.append(r)
        while landing and landing[0][0] <= now:
            _, _, r = heapq.heappop(landing)
            w.stall_s += r.isl * bytes_per_token / bandwidth
            r.todo = 1  # the engine recomputes the last prompt token
            w.waiting.append(r)
        end = w.step(now, gaps, ttfts)
        nxt = min(arrivals[i].arrival if i < len(arrivals) else seconds, landing[0][0] if landing else seconds)
        now = end if end > now else max(now + 1e-4, nxt)
    backlog = len(w.waiting) + len(landing) > 2 * w.max_batch or max(pool, default=0.0) > seconds + 30.0
    return _result(gaps, ttfts, remote / max(longs, 1), backlog)


def _goes_remote(r: _Req, w: _Worker, pool: list[float], now: float, threshold: int | str, rate: float,
                 bytes_per_token: float, bandwidth: float, arrival_rate: float) -> bool:
    if threshold != AUTO:
        return r.isl >= int(threshold)
    est = PdEstimate(uncached_tokens=r.isl, prefill_tokens=r.isl, decode_batch=len(w.running), decode_rate=rate,
                     prefill_rate=rate, decode_queue_s=w.queued_tokens() / rate,
                     prefill_queue_s=max(0.0, min(pool) - now), transfer_s=r.isl * bytes_per_token / bandwidth,
                     arrival_rate=arrival_rate)
    return est.disaggregate


def _arrivals(rng: random.Random, t: PdTraffic, rate_short: float, rate_long: float, seconds: float,
              mine: float) -> list[_Req]:
    """This decode worker's short requests, and the fleet's long documents (``mine`` of them its own)."""
    out = []
    for rate, short in ((rate_short, True), (rate_long, False)):
        at = rng.expovariate(rate) if rate > 0 else seconds
        while at < seconds:
            isl, osl = (t.short_isl, t.short_osl) if short else (rng.randint(*t.long_isl), t.long_osl)
            out.append(_Req(at, isl, osl, short, mine=short or rng.random() < mine))
            at += rng.expovariate(rate)
    return sorted(out, key=lambda r: r.arrival)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] * 1e3


def _result(gaps: list[float], ttfts: tuple[list[float], list[float]], remote: float, saturated: bool) -> PdResult:
    return PdResult(short_itl_p99_ms=_pct(gaps, 99), short_itl_p50_ms=_pct(gaps, 50),
                    long_ttft_p90_ms=_pct(ttfts[1], 90), short_ttft_p90_ms=_pct(ttfts[0], 90), remote_share=remote,
                    saturated=saturated)


def rate_for_load(profile: TimingProfile, traffic: PdTraffic, load: float, batch: int = 4) -> float:
    """Requests/s per worker that keep a colocated worker busy ``load`` of the time (prefills alone, decode
    steps shared by ``batch`` requests): the same offered traffic for every split of one fleet."""
    mean_long = sum(traffic.long_isl) / 2
    prefill = (traffic.long_share * profile.step_seconds(0, int(mean_long))
               + (1 - traffic.long_share) * profile.step_seconds(0, traffic.short_isl))
    osl = traffic.long_share * traffic.long_osl + (1 - traffic.long_share) * traffic.short_osl
    decode = osl * profile.step_seconds(batch, 0) / batch
    return load / (prefill + decode)
