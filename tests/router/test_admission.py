"""The admission stage without HTTP: when a worker counts as saturated, and a waiting request released as soon
as room appears, each let-through request holding its place until it is dispatched."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from fleetllm.router.pipeline.admission import FlowControl, FlowLimits, queued_at, room
from fleetllm.router.tenancy import Tenant, TenantMetrics
from fleetllm.router.upstream import WorkerState


def worker(**kw) -> WorkerState:
    return WorkerState("w", "http://w", healthy=True, **kw)


def test_a_fleetllm_workers_queue_is_its_report_plus_what_was_sent_less_what_ended_since():
    reporting = worker(kind="fleetllm", events_connected=True, waiting=1, sent_since_report=3, ended_since_report=1)
    drained = worker(kind="fleetllm", events_connected=True, waiting=1, sent_since_report=0, ended_since_report=4)
    assert (queued_at(reporting), queued_at(drained)) == (3, 0)


def test_another_engines_queue_is_the_routers_requests_without_a_first_byte():
    assert queued_at(worker(kind="vllm", waiting=5, inflight=4, decoding=1)) == 3


def test_room_is_each_workers_queue_short_of_the_limit_and_none_on_a_nearly_full_kv_cache():
    limits = FlowLimits(worker_queue=2, kv_usage=0.9)
    assert room([worker(inflight=1), worker(inflight=5)], limits) == 1
    assert room([worker(kv_usage=0.95)], limits) == 0


def test_a_waiting_request_goes_once_its_worker_has_room_and_holds_its_place_until_dispatched():
    async def run() -> tuple[int, int, int]:
        w = worker(inflight=2)  # its queue is full (no reports: the router's requests without a first byte)
        flow = FlowControl(FlowLimits(worker_queue=2), TenantMetrics(CollectorRegistry()))
        waiting = asyncio.create_task(flow.admit("m", lambda: [w], Tenant("t"), "normal", 5.0))
        await asyncio.sleep(0.05)
        queued = len(flow.gates["m"].queue)
        w.inflight = 1  # a request ended
        flow.kick()
        ticket = await asyncio.wait_for(waiting, 1.0)
        in_transit = flow.gates["m"].in_transit
        ticket.dispatched()
        ticket.dispatched()  # once only
        await flow.close()
        return queued, in_transit, flow.gates["m"].in_transit

    assert asyncio.run(run()) == (1, 1, 0)
