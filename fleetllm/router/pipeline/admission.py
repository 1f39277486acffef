"""The admission stage: flow control before a worker is picked (``--flow-control``), as llm-d's flow control.

The router holds requests and releases to the workers only what they can start now, so a worker's own queue
stays empty and the order (priority band first, then weighted fair queuing between tenants) is decided here,
where every tenant is seen, not first come first served in a worker's queue. While some copy of the request's
model has room and nothing waits, a request goes straight on (no queue, no task); otherwise it waits in the
model's :class:`~fleetllm.router.pipeline.fair_queue.FairQueue` and is released as room appears.

A worker's *room* (:func:`worker_room`): for a fleetllm worker, its batch slots (``max_num_seqs``, from its
snapshot) less the requests it holds (:func:`occupied`), so a request released to it is admitted to its running
batch at its next step; for another engine (no slots reported), room while fewer than one request of this
router's waits there with no first byte (:func:`queued_at`). ``--flow-worker-queue`` lets that many more wait at
each worker (a deeper queue there: fuller batches between the router's releases, later turns for the urgent);
by default one at a worker under ``--scheduling-policy priority``, none elsewhere (:func:`queue_depth`).
A worker whose KV pool is ``--flow-kv-usage`` full has no room.

*Headroom* (``--flow-headroom``): bulk work leaves that fraction of each worker's slots free, so a request that is
not bulk finds a slot at once instead of waiting for one to end. Bulk work is the low band (batch lines) and the
requests of a tenant holding its weighted share of the slots, now and on average over ``--flow-share-window``
(:meth:`Gate.bulk`: a flood, not a burst). While the head
of the queue is bulk work held out of the headroom, the first request that is not bulk may still take it. A worker
that displaces bulk work (below) keeps no headroom: there an urgent request takes a bulk request's slot at once,
and a slot kept free would cost the bulk work that slot all the time.

*Displacing bulk work*: the headroom is soon taken when the other tenants' work lasts (their requests in flight
outnumber the slots kept), and a request that is not bulk would then wait for some request to end. A bulk request
is sent with ``x-fleetllm-bulk``, and a worker under ``--scheduling-policy priority`` serves it a level less
urgent, giving its batch slot to a more urgent request that arrives while every slot is taken (the bulk one is
preempted: recomputed later, its prefix still cached). So for work that is not bulk, such a worker's room leaves
out this router's bulk requests there (:func:`displaceable`), and the request is sent at once.

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
from fleetllm.router.pipeline.held_average import HeldAverage
from fleetllm.server.protocol import APIError

if TYPE_CHECKING:
    from fleetllm.router.tenancy import Tenant, TenantMetrics
    from fleetllm.router.upstream import WorkerState

POLL_S = 0.02  # how often a waiting queue looks again without a kick (the workers' own load reports)
RETRY_AFTER_S = "1"
LOW = len(BANDS) - 1  # the low band's index: batch work, bulk whoever sends it


@dataclass
class FlowLimits:
    """When a worker has room, and how much may wait at the router."""

    worker_queue: int | None = None  # requests a worker may hold beyond those it can start now (None: queue_depth)
    kv_usage: float = 0.95  # KV usage that leaves a worker no room
    queue_max: int = 1024  # requests waiting at the router per model, all bands together
    timeout_s: float = 60.0  # the longest a request waits unless it says less
    aging_s: float = 10.0  # a band's oldest request climbs one band per this many seconds waited
    headroom: float = 0.125  # the fraction of each worker's batch slots bulk work leaves free
    share_window_s: float = 2.0  # a tenant is bulk holding its share on average over about this long (0: at once)


def queued_at(w: WorkerState) -> int:
    """Requests waiting at ``w`` (not yet in its running batch) as the router sees them now.

    A fleetllm worker reports its waiting requests within 50 ms of a change (its KV-event stream); what this router
    sent since the last report is added, and what ended since taken off (each ended request freed a slot that a
    waiting one takes): a busy worker's queue is refilled as its requests end, not a report later. Without such
    reports, the router's requests with no first byte."""
    if w.kind == "fleetllm" and w.events_connected:
        return max(0, w.waiting + w.sent_since_report - w.ended_since_report)
    return w.inflight - w.decoding


def reports_slots(w: WorkerState) -> bool:
    """Whether the router knows ``w``'s batch slots and how many it holds (a fleetllm worker's KV-event stream)."""
    return w.kind == "fleetllm" and w.events_connected and bool(w.max_num_seqs)


def occupied(w: WorkerState) -> int:
    """Requests ``w`` runs or holds waiting now: this router's in flight there (its own count: exact and current)
    and the other routers' as of the worker's last report (:meth:`~fleetllm.router.upstream.WorkerState.load_report`).
    A late report never counts this router's ended requests as still there."""
    return w.inflight + w.others


def displaces(w: WorkerState) -> bool:
    """Whether ``w`` gives a more urgent request the batch slot of a running less urgent one: a worker under
    ``--scheduling-policy priority``, which serves bulk work a level less urgent (``x-fleetllm-bulk``)."""
    return w.scheduling_policy == "priority"


def displaceable(w: WorkerState) -> int:
    """This router's bulk requests at ``w`` whose batch slots a more urgent request would take (:func:`displaces`)."""
    return w.bulk_inflight if displaces(w) else 0


def queue_depth(w: WorkerState, limits: FlowLimits) -> int:
    """Requests ``w`` may hold waiting beyond those it can start now: ``worker_queue``, by default one at a worker
    under ``--scheduling-policy priority`` and none elsewhere. Waiting there, the next request starts in the step
    after a running one ends, where released from the router it would miss that step (the end's report, the
    release and its forwarding take longer than a step); a more urgent request passes it at such a worker, so it
    delays nobody more urgent. At a first-come-first-served worker it would delay an urgent request behind it."""
    if limits.worker_queue is not None:
        return limits.worker_queue
    return 1 if displaces(w) else 0


def worker_room(w: WorkerState, limits: FlowLimits, bulk: bool = False) -> int:
    """Requests ``w`` can take now; ``bulk`` work leaves the headroom free, and other work does not count the
    bulk requests there it would displace (see the module's docstring)."""
    if w.kv_usage >= limits.kv_usage:
        return 0
    if not reports_slots(w):
        return max(0, max(1, queue_depth(w, limits)) - queued_at(w))
    slots = w.max_num_seqs or 0
    # at least one slot kept, and never all of them; none at a worker that displaces bulk work for urgent work
    if bulk and limits.headroom > 0 and not displaces(w):
        slots -= min(slots - 1, max(1, round(limits.headroom * slots)))
    taken = occupied(w) - (0 if bulk else displaceable(w))
    return max(0, slots + queue_depth(w, limits) - taken)


def room(workers: list[WorkerState], limits: FlowLimits, bulk: bool = False) -> int:
    """Requests (``bulk`` work or not) that ``workers`` could take now."""
    return sum(worker_room(w, limits, bulk) for w in workers)


class Gate:
    """One model's queue, the requests let through that have not reached a worker yet, and each tenant's requests
    let through that have not ended."""

    def __init__(self, limits: FlowLimits, workers: Callable[[], list[WorkerState]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.held = HeldAverage(limits.share_window_s)  # each tenant's slots held, averaged over time
        self.queue = FairQueue(limits.queue_max, limits.aging_s)
        self.workers = workers  # the model's routable decode workers, looked up afresh
        self.in_transit = 0  # released (or let straight through) and not yet dispatched
        self.holding: dict[str, int] = {}  # per tenant: let through and not ended
        self.weights: dict[str, float] = {}  # per tenant holding or waiting: its weight
        # per tenant, (holding, weight) through the other routers sharing the state store (shared_flow.py)
        self.others: dict[str, tuple[int, float]] = {}
        self.wake = asyncio.Event()
        self.pump: asyncio.Task[None] | None = None

    def free(self, bulk: bool) -> int:
        """Requests (``bulk`` work or not) that may go on now; with no routable worker at all, any number (each is
        answered 503 at once by the forwarder rather than held)."""
        workers = self.workers()
        return room(workers, self.limits, bulk) - self.in_transit if workers else 1 << 30

    def held_now(self, tenant_id: str) -> int:
        """``tenant_id``'s requests let through and not ended, through every router sharing the state store."""
        return self.holding.get(tenant_id, 0) + self.others.get(tenant_id, (0, 0.0))[0]

    def hold(self, tenant_id: str, change: int) -> None:
        """One request of ``tenant_id`` let through (+1) or ended (-1)."""
        self.holding[tenant_id] = self.holding.get(tenant_id, 0) + change
        self.held.note(tenant_id, self.held_now(tenant_id), self.clock())

    def bulk(self, tenant: Tenant, band: int) -> bool:
        """Whether a request is bulk work: the low band's, or its tenant's while the tenant holds its weighted
        share of the model's batch slots or more (through every router sharing the state store), both now and on
        average over ``share_window_s`` (a burst of a tenant under its share is not a flood); the share counting
        one more tenant (of weight 1) when it is alone, so one busy tenant is bulk before a second one arrives."""
        if band == LOW:
            return True
        if self.limits.headroom <= 0:
            return False
        slots = sum(w.max_num_seqs or 0 for w in self.workers() if reports_slots(w))
        if not slots:  # a share of no known slots: nobody's work is bulk (nor sent as such)
            return False
        weights = {**{t: w for t, (_, w) in self.others.items()}, **self.weights}
        active = sum(weights.values()) + (0.0 if tenant.id in weights else tenant.weight)
        holding = self.held_now(tenant.id)
        holding = min(holding, self.held.note(tenant.id, holding, self.clock()))
        return holding + 1 > slots * tenant.weight / max(active, tenant.weight + 1.0)

    def next(self, now: float) -> tuple[Entry, bool] | None:
        """The queued request that may go now and whether it is bulk, if any: the queue's head, or while the head
        is bulk work held out of the headroom, the first request (band, then tag) that is not bulk."""
        head = self.queue.peek(now)
        if head is None:
            return None
        bulk = self.bulk(head.payload[0], head.band)
        if self.free(bulk) > 0:
            return head, bulk
        if not bulk or self.limits.headroom <= 0 or self.free(False) <= 0:
            return None
        light = self.queue.first(lambda e: not self.bulk(e.payload[0], e.band), LOW)
        return (light, False) if light is not None else None

    def forget(self, tenant: Tenant) -> None:
        """Drop ``tenant``'s weight once it holds and waits for nothing."""
        if not self.holding.get(tenant.id) and not self.queue.waiting(tenant.id):
            self.holding.pop(tenant.id, None)
            self.weights.pop(tenant.id, None)
            self.held.forget(tenant.id)


class Ticket:
    """A request let through: it holds a place in its gate's in-transit count until it is dispatched, and one of
    its tenant's until it ended."""

    def __init__(self, gate: Gate, tenant: Tenant, bulk: bool) -> None:
        self.gate: Gate | None = gate
        self.holds: Gate | None = gate
        self.tenant = tenant
        self.bulk = bulk  # released as bulk work: its worker must have room beyond the headroom
        gate.in_transit += 1
        gate.hold(tenant.id, +1)
        gate.weights[tenant.id] = tenant.weight

    def dispatched(self) -> None:
        """The request reached a worker (or ended without one): idempotent."""
        if self.gate is not None:
            self.gate.in_transit -= 1
            self.gate.wake.set()
            self.gate = None

    def finished(self) -> None:
        """The request ended (answered, failed or abandoned): idempotent."""
        self.dispatched()
        if self.holds is not None:
            self.holds.hold(self.tenant.id, -1)
            self.holds.forget(self.tenant)
            self.holds.wake.set()
            self.holds = None


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

    def has_room(self, w: WorkerState, bulk: bool) -> bool:
        """Whether ``w`` can start one more request (``bulk`` work or not) now: the forwarder's candidates for a
        released request."""
        return worker_room(w, self.limits, bulk) > 0

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
            gate = self.gates[model] = Gate(self.limits, workers, self.clock)
        bulk = gate.bulk(tenant, BANDS.index(priority_band))
        if not len(gate.queue) and gate.free(bulk) > 0:
            return Ticket(gate, tenant, bulk)
        waiter: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        entry = Entry(tenant.id, BANDS.index(priority_band), self.clock(), payload=(tenant, waiter))
        shed = gate.queue.push(entry, tenant.weight)
        if shed is entry:
            self.metrics.refused_tenant(tenant, priority_band, "queue_full")
            raise _shed(429, f"the router's queue for this model is full ({self.limits.queue_max} waiting)")
        if shed is not None:
            self._displace(shed)
        self.metrics.waiting(tenant, priority_band, +1)
        gate.weights[tenant.id] = tenant.weight
        self._release(gate)  # a light tenant's arrival may take the headroom now, not on the pump's next turn
        if len(gate.queue) and (gate.pump is None or gate.pump.done()):
            gate.pump = asyncio.create_task(self._pump(gate), name=f"flow-{model}")
        return await self._wait(gate, entry, waiter, timeout_s or self.limits.timeout_s)

    async def _wait(self, gate: Gate, entry: Entry, waiter: asyncio.Future[Ticket], timeout_s: float) -> Ticket:
        tenant, band = entry.payload[0], BANDS[entry.band]
        try:
            if waiter.done():  # released at its arrival: on at once, not after turns of a busy event loop
                return waiter.result()
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            if not waiter.done():
                self.metrics.refused_tenant(tenant, band, "deadline")
                raise _shed(503, f"no worker had room for this request within {timeout_s:g} s") from None
            return waiter.result()  # released in the same instant
        except asyncio.CancelledError:  # the client went away
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                waiter.result().finished()
            raise
        finally:
            if gate.queue.remove(entry):
                self.metrics.waiting(tenant, band, -1)
            if not waiter.done():
                waiter.cancel()
            gate.forget(tenant)

    def _displace(self, e: Entry) -> None:
        tenant, waiter = e.payload
        band = BANDS[e.band]
        self.metrics.waiting(tenant, band, -1)
        self.metrics.refused_tenant(tenant, band, "displaced")
        if not waiter.done():
            waiter.set_exception(_shed(503, "shed from the router's full queue for a more urgent request"))

    def _release(self, gate: Gate) -> None:
        """Release the queued requests that may go now, in order."""
        now = self.clock()
        while (release := gate.next(now)) is not None:
            e, bulk = release
            gate.queue.take(e)
            tenant, waiter = e.payload
            self.metrics.waiting(tenant, BANDS[e.band], -1)
            if not waiter.done():
                waiter.set_result(Ticket(gate, tenant, bulk))

    async def _pump(self, gate: Gate) -> None:
        """Release queued requests while the model's workers have room; sleeps on a kick or POLL_S."""
        while len(gate.queue):
            self._release(gate)
            gate.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gate.wake.wait(), POLL_S)


def _shed(status: int, message: str) -> APIError:
    return APIError(status, message, headers={"Retry-After": RETRY_AFTER_S})
