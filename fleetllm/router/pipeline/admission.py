"""The admission stage: flow control before a worker is picked (``--flow-control``), as llm-d's flow control.

While some copy of the request's model has room, a request goes straight on (nothing else waiting: no
queue, no task). When every copy is saturated, it waits at the router in the model's
:class:`~fleetllm.router.pipeline.fair_queue.FairQueue` (priority bands, weighted fair queuing between tenants)
and is released as room appears. A worker is *saturated* when ``--flow-worker-queue`` requests already wait
there (:func:`queued_at`) or its KV pool is ``--flow-kv-usage`` full. So the workers' own queues stay short and
the router, which sees every tenant, decides who goes next.

Shedding, in OpenAI's error format with ``Retry-After``:

- a request arriving at a full queue (``--flow-queue-max``) pushes out the newest request of a lower band (503,
  reason ``displaced``), or, with none below it, is refused itself (429, reason ``queue_full``);
- a request still queued at its deadline (its ``timeout`` / ``x-request-timeout``, else ``--flow-queue-timeout-s``)
  is refused (503, reason ``deadline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetllm.router.pipeline.fair_queue import BANDS, Entry, FairQueue
from fleetllm.server.protocol import APIError

if TYPE_CHECKING:
    from fleetllm.router.tenancy import Tenant, TenantMetrics
    from fleetllm.router.upstream import WorkerState

POLL_S = 0.02  # how often a waiting queue looks again without a kick (the workers' own load reports)
RETRY_AFTER_S = "1"


@dataclass
class FlowLimits:
    """When a worker is saturated, and how much may wait."""

    worker_queue: int = 2  # requests waiting at a worker that saturate it
    kv_usage: float = 0.95  # KV usage that saturates a worker
    queue_max: int = 1024  # requests waiting at the router per model, all bands together
    timeout_s: float = 60.0  # the longest a request waits unless it says less
    aging_s: float = 10.0  # a band's oldest request climbs one band per this many seconds waited


def queued_at(w: WorkerState) -> int:
    """Requests waiting at ``w`` (not yet in its running batch) as the router sees them now.

    A fleetllm worker reports its waiting requests within 50 ms of a change (its KV-event stream); what this router
    sent since the last report is added, and what ended since taken off (each ended request freed a slot that a
    waiting one takes): a busy worker's queue is refilled as its requests end, not a report later. Without such
    reports, the router's requests with no first byte."""
    if w.kind == "fleetllm" and w.events_connected:
        return max(0, w.waiting + w.sent_since_report - w.ended_since_report)
    return w.inflight - w.decoding


def room(workers: list[WorkerState], limits: FlowLimits) -> int:
    """Requests ``workers`` could take now before every one is saturated."""
    return sum(max(0, limits.worker_queue - queued_at(w)) for w in workers if w.kv_usage < limits.kv_usage)


class Gate:
    """One model's queue, and the requests let through that have not reached a worker yet."""

    def __init__(self, limits: FlowLimits, workers: Callable[[], list[WorkerState]]) -> None:
        self.queue = FairQueue(limits.queue_max, limits.aging_s)
        self.workers = workers  # the model's routable decode workers, looked up afresh
        self.in_transit = 0  # released (or let straight through) and not yet dispatched
        self.wake = asyncio.Event()
        self.pump: asyncio.Task[None] | None = None

    def free(self, limits: FlowLimits) -> int:
        """Requests that may go on now; with no routable worker at all, any number (each is answered 503 at
        once by the forwarder rather than held)."""
        workers = self.workers()
        return room(workers, limits) - self.in_transit if workers else 1 << 30


class Ticket:
    """A request let through: it holds a place in its gate's in-transit count until it is dispatched."""

    def __init__(self, gate: Gate) -> None:
        self.gate: Gate | None = gate
        gate.in_transit += 1

    def dispatched(self) -> None:
        """The request reached a worker (or ended without one): idempotent."""
        if self.gate is not None:
            self.gate.in_transit -= 1
            self.gate.wake.set()
            self.gate = None


class FlowControl:
    """The admission stage: one :class:`Gate` per served model."""

    def __init__(self, limits: FlowLimits, metrics: TenantMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.metrics = metrics
        self.clock = clock
        self.gates: dict[str, Gate] = {}

    async def close(self) -> None:
        """Stop the queues' release tasks (the router is shutting down; its requests are being cancelled)."""
        pumps = [g.pump for g in self.gates.values() if g.pump is not None]
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

    def kick(self) -> None:
        """Load changed somewhere (a request ended, was dispatched): queues look again now."""
        for g in self.gates.values():
            if len(g.queue):
                g.wake.set()

    async def admit(self, model: str, workers: Callable[[], list[WorkerState]], tenant: Tenant, priority_band: str,
                    timeout_s: float | None) -> Ticket:
        """Let the request through now or once there is room; raises APIError 429/503 when it is shed."""
        gate = self.gates.get(model)
        if gate is None:
            gate = self.gates[model] = Gate(self.limits, workers)
        if not len(gate.queue) and gate.free(self.limits) > 0:
            return Ticket(gate)
        waiter: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        entry = Entry(tenant.id, BANDS.index(priority_band), self.clock(), payload=(tenant, waiter))
        shed = gate.queue.push(entry, tenant.weight)
        if shed is entry:
            self.metrics.refused_tenant(tenant, priority_band, "queue_full")
            raise _shed(429, f"the router's queue for this model is full ({self.limits.queue_max} waiting)")
        if shed is not None:
            self._displace(shed)
        self.metrics.waiting(tenant, priority_band, +1)
        if gate.pump is None or gate.pump.done():
            gate.pump = asyncio.create_task(self._pump(gate), name=f"flow-{model}")
        return await self._wait(gate, entry, waiter, timeout_s or self.limits.timeout_s)

    async def _wait(self, gate: Gate, entry: Entry, waiter: asyncio.Future[Ticket], timeout_s: float) -> Ticket:
        tenant, band = entry.payload[0], BANDS[entry.band]
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            if not waiter.done():
                self.metrics.refused_tenant(tenant, band, "deadline")
                raise _shed(503, f"no worker had room for this request within {timeout_s:g} s") from None
            return waiter.result()  # released in the same instant
        except asyncio.CancelledError:  # the client went away
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                waiter.result().dispatched()
            raise
        finally:
            if gate.queue.remove(entry):
                self.metrics.waiting(tenant, band, -1)
            if not waiter.done():
                waiter.cancel()

    def _displace(self, e: Entry) -> None:
        tenant, waiter = e.payload
        band = BANDS[e.band]
        self.metrics.waiting(tenant, band, -1)
        self.metrics.refused_tenant(tenant, band, "displaced")
        if not waiter.done():
            waiter.set_exception(_shed(503, "shed from the router's full queue for a more urgent request"))

    async def _pump(self, gate: Gate) -> None:
        """Release queued requests while the model's workers have room; sleeps on a kick or POLL_S."""
        while len(gate.queue):
            while len(gate.queue) and gate.free(self.limits) > 0:
                e = gate.queue.pop(self.clock())
                tenant, waiter = e.payload
                self.metrics.waiting(tenant, BANDS[e.band], -1)
                if not waiter.done():
                    waiter.set_result(Ticket(gate))
            gate.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gate.wake.wait(), POLL_S)


def _shed(status: int, message: str) -> APIError:
    return APIError(status, message, headers={"Retry-After": RETRY_AFTER_S})
