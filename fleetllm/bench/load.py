"""Load generation: turns a workload's sessions into timed requests.

Three timings: a closed loop of N users (``concurrency``), an open loop of session arrivals at a
``request_rate`` (constant, Poisson or gamma gaps, optionally capped by ``concurrency``), and trace
replay (the sessions' own ``arrival_s``). Every measured request is claimed from one budget (request
count and deadline), so limits hold in all three. Warm-up runs first, under its own budget, and its
records are kept apart so they never reach the metrics.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import httpx
import numpy as np

from fleetllm.bench.client import ClientConfig, RequestRecord, RequestSpec, make_http_client, send_request
from fleetllm.bench.workloads import Session, Turn, Workload

ARRIVALS = ("constant", "poisson", "gamma")


@dataclass
class LoadConfig:
    """How hard and how long to push. Give ``concurrency``, ``request_rate``, or neither for a trace."""

    concurrency: int | None = None
    request_rate: float | None = None  # sessions per second (= requests/s for one-turn workloads)
    arrival: str = "poisson"
    burstiness: float = 1.0  # gamma shape k: < 1 burstier than Poisson, > 1 smoother, 1 = Poisson
    max_requests: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 0
    ramp_up_s: float = 0.0
    max_waiting_first_token: int | None = None  # cap on requests sent but without a first token
    cancel_ratio: float = 0.0
    seed: int = 0

    def label(self) -> str:
        """A short name for this load point, e.g. ``c=4`` or ``rate=2.0``."""
        if self.request_rate is not None:
            return f"rate={self.request_rate:g}"
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return "trace"


@dataclass
class RunResult:
    """Records of one load point; ``start_ns``/``end_ns`` bound the measured phase."""

    load: LoadConfig
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    start_ns: int
    end_ns: int


def arrival_gaps(rng: np.random.Generator, rate: float, arrival: str, burstiness: float = 1.0) -> Iterator[float]:
    """Inter-arrival gaps in seconds with mean ``1/rate``."""
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    while True:
        if arrival == "constant":
            yield 1.0 / rate
        elif arrival == "poisson":
            yield float(rng.exponential(1.0 / rate))
        else:
            # Gamma(k, 1/(rate*k)) keeps the mean at 1/rate while k sets the burstiness.
            yield float(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


def arrival_offsets(rate: float, seed: int, arrival: str = "poisson", burstiness: float = 1.0,
                    ramp_up_s: float = 0.0) -> Iterator[float]:
    """Seconds after the measured phase starts at which an open loop sends each session: the same times for
    the same seed, so a simulation can replay the very arrivals a run had."""
    gaps = arrival_gaps(np.random.default_rng(seed + 104729), rate, arrival, burstiness)
    tau = 0.0
    for gap in gaps:
        yield ramped_time(tau, ramp_up_s)
        tau += gap


def ramped_time(tau: float, ramp_up_s: float) -> float:
    """Real time of an arrival scheduled at ``tau`` under full rate, when the rate ramps linearly
    from 0 to full over ``ramp_up_s`` (inverse of the cumulative intensity)."""
    if ramp_up_s <= 0:
        return tau
    if tau <= ramp_up_s / 2:
        return math.sqrt(2 * ramp_up_s * tau)
    return tau + ramp_up_s / 2


@dataclass
class _Phase:
    max_requests: int | None
    deadline_ns: int | None
    warmup: bool
    issued: int = 0
    records: list[RequestRecord] = field(default_factory=list)

    def exhausted(self) -> bool:
        return self.max_requests is not None and self.issued >= self.max_requests

    def open(self) -> bool:
        return self.deadline_ns is None or time.perf_counter_ns() < self.deadline_ns

    def claim(self, turns: int) -> int:
        """Reserve up to ``turns`` requests for one session; 0 when the budget or time is spent.

        A session reserves all its turns when it starts, so a request limit yields whole
        conversations rather than many first turns whose follow-ups never get sent."""
        if not self.open():
            return 0
        granted = turns if self.max_requests is None else min(turns, self.max_requests - self.issued)
        self.issued += max(granted, 0)
        return max(granted, 0)


class LoadRunner:
    """Runs one load point against one server; ``on_record`` sees every finished measured request."""

    def __init__(
        self,
        client: ClientConfig,
        load: LoadConfig,
        workload: Workload,
        on_record: Callable[[RequestRecord], None] | None = None,
    ):
        if load.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {load.arrival!r}")
        self.client = client
        self.load = load
        self.workload = workload
        self.on_record = on_record
        self._rng = np.random.default_rng(load.seed + 7919)  # cancellation draws, apart from the workload's
        self._next_id = 0
        self._concurrency_cap: asyncio.Semaphore | None = None
        self._first_token_cap: asyncio.Semaphore | None = None
        self._http: httpx.AsyncClient | None = None

    async def run(self) -> RunResult:
        """Warm up, then run the measured phase; returns once every in-flight request has ended."""
        load = self.load
        # Enough pooled connections that requests never queue inside httpx (that wait would land in TTFT).
        width = load.concurrency or max(load.max_waiting_first_token or 0, 1024)
        async with AsyncExitStack() as stack:
            self._http = await stack.enter_async_context(make_http_client(self.client, width))
            if load.max_waiting_first_token:
                self._first_token_cap = asyncio.Semaphore(load.max_waiting_first_token)
            warm = _Phase(load.warmup_requests, None, warmup=True)
            if load.warmup_requests:
                users = min(load.concurrency or 1, load.warmup_requests)
                await self._closed_loop(warm, self.workload.sessions(load.seed + 1_000_003), users, ramp=False)
            start = time.perf_counter_ns()
            deadline = start + int(load.duration_s * 1e9) if load.duration_s else None
            phase = _Phase(load.max_requests, deadline, warmup=False)
            sessions = self.workload.sessions(load.seed)
            if load.request_rate is not None:
                if load.concurrency:
                    self._concurrency_cap = asyncio.Semaphore(load.concurrency)
                await self._open_loop(phase, sessions, start, self._rate_offsets())
            elif load.concurrency is not None:
                await self._closed_loop(phase, sessions, load.concurrency, ramp=True)
            else:
                await self._open_loop(phase, sessions, start, None)
            end = time.perf_counter_ns()
        return RunResult(load, phase.records, warm.records, start, end)

    def _rate_offsets(self) -> Iterator[float]:
        load = self.load
        assert load.request_rate is not None
        return arrival_offsets(load.request_rate, load.seed, load.arrival, load.burstiness, load.ramp_up_s)

    async def _closed_loop(self, phase: _Phase, sessions: Iterator[Session], users: int, ramp: bool) -> None:
        async def user(i: int) -> None:
            if ramp and self.load.ramp_up_s > 0:
                await asyncio.sleep(i * self.load.ramp_up_s / users)
            for session in sessions:
                granted = phase.claim(len(session.turns))
                if not granted:
                    return
                await self._run_session(session, phase, time.perf_counter_ns(), granted)

        await asyncio.gather(*(user(i) for i in range(users)))

    async def _open_loop(
        self, phase: _Phase, sessions: Iterator[Session], start: int, offsets: Iterator[float] | None
    ) -> None:
        tasks: list[asyncio.Task[None]] = []
        for session in sessions:
            if phase.exhausted():
                break  # without waiting for one more arrival that could not be sent
            offset = next(offsets) if offsets is not None else (session.arrival_s or 0.0)
            due = start + int(offset * 1e9)
            delay = (due - time.perf_counter_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            granted = phase.claim(len(session.turns))
            if not granted:
                break
            tasks.append(asyncio.create_task(self._run_session(session, phase, due, granted)))
        await asyncio.gather(*tasks)

    async def _run_session(self, session: Session, phase: _Phase, scheduled_ns: int, turns: int) -> None:
        """Send the first ``turns`` turns in order (their budget was claimed by the caller)."""
        history: list[dict[str, str]] = []
        context_tokens = session.system_tokens
        for t, turn in enumerate(session.turns[:turns]):
            if t:
                if turn.think_time_s > 0:
                    await asyncio.sleep(turn.think_time_s)
                if not phase.open():
                    return
                scheduled_ns = time.perf_counter_ns()
            spec = self._spec(session, t, turn, history, context_tokens)
            rec = await self._send(spec, scheduled_ns, phase.warmup)
            phase.records.append(rec)
            if not phase.warmup and self.on_record is not None:
                self.on_record(rec)
            if not rec.ok:
                return  # a conversation whose reply is missing cannot continue faithfully
            history += [{"role": "user", "content": turn.content}, {"role": "assistant", "content": rec.output_text}]
            context_tokens += turn.input_tokens + (rec.output_tokens or 0)

    def _spec(
        self, session: Session, t: int, turn: Turn, history: list[dict[str, str]], context_tokens: int
    ) -> RequestSpec:
        if turn.messages is not None:
            messages = turn.messages
        else:
            system = [{"role": "system", "content": session.system}] if session.system else []
            messages = system + history + [{"role": "user", "content": turn.content}]
        cancel_after = None
        if self.load.cancel_ratio > 0 and self._rng.random() < self.load.cancel_ratio:
            cancel_after = int(self._rng.integers(1, max(2, turn.max_tokens // 2 + 1)))
        return RequestSpec(
            max_tokens=turn.max_tokens,
            messages=messages,
            session_id=session.session_id,
            turn=t,
            expected_input_tokens=context_tokens + turn.input_tokens if turn.input_tokens else None,
            cancel_after_chunks=cancel_after,
            body=turn.body,
        )

    async def _send(self, spec: RequestSpec, scheduled_ns: int, warmup: bool) -> RequestRecord:
        assert self._http is not None
        async with AsyncExitStack() as stack:
            if self._concurrency_cap is not None:
                await stack.enter_async_context(self._concurrency_cap)
            released = False
            cap = self._first_token_cap

            def release() -> None:
                nonlocal released
                if cap is not None and not released:
                    released = True
                    cap.release()

            if cap is not None:
                await cap.acquire()
            try:
                rid = self._next_id
                self._next_id += 1
                rec = await send_request(self._http, self.client, spec, rid, scheduled_ns, on_first_token=release)
            finally:
                release()
        rec.warmup = warmup
        return rec


def run_load(client: ClientConfig, load: LoadConfig, workload: Workload,
             on_record: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Synchronous entry point: run one load point to completion."""
    return asyncio.run(LoadRunner(client, load, workload, on_record).run())
