"""The admission stage without HTTP: a worker's room (its free batch slots, or its queue for other engines), the
headroom bulk work leaves, a waiting request released as soon as room appears (each let-through request holding
its place until it is dispatched), and tenants' slots counted through every router sharing a store."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry

from fleetllm.router.pipeline.admission import (
    FlowControl,
    FlowLimits,
    Gate,
    occupied,
    queued_at,
    room,
    worker_room,
)
from fleetllm.router.pipeline.shared_flow import SharedFlow
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


def fleetllm_worker(**kw) -> WorkerState:
    """A fleetllm worker whose KV-event stream reported its batch slots (``max_num_seqs``) and load."""
    return worker(kind="fleetllm", events_connected=True, **kw)


def test_a_fleetllm_worker_has_room_for_its_free_batch_slots_less_the_routers_requests_and_other_routers():
    shared = fleetllm_worker(max_num_seqs=8, inflight=3)
    shared.load_report(running=5, waiting=0)  # 3 of this router's, so 2 of another's
    alone = fleetllm_worker(max_num_seqs=8, inflight=7)
    alone.load_report(running=2, waiting=0)  # its requests are still arriving: no other router's
    assert (occupied(shared), occupied(alone)) == (5, 7)
    assert room([shared, alone], FlowLimits()) == 3 + 1
    assert room([shared], FlowLimits(worker_queue=2)) == 5  # a deeper queue allowed at the worker


def test_a_late_report_still_counting_requests_the_router_saw_end_holds_no_slot():
    w = fleetllm_worker(max_num_seqs=8)
    for _ in range(8):
        w.dispatched()
    w.load_report(running=8, waiting=0)  # full
    w.inflight -= 3  # three ended: their answers were relayed before the worker's next report came
    w.load_report(running=8, waiting=0)  # that report, taken before they ended, arrives now
    assert (occupied(w), worker_room(w, FlowLimits())) == (5, 3)


def test_other_routers_requests_count_from_each_report():
    w = fleetllm_worker(max_num_seqs=8)
    w.dispatched()
    w.load_report(running=6, waiting=2)  # one of this router's: seven of others'
    busy = worker_room(w, FlowLimits())
    w.load_report(running=3, waiting=0)  # others' ended
    assert (w.others, busy, worker_room(w, FlowLimits())) == (2, 0, 5)


def test_bulk_work_leaves_the_headroom_of_each_workers_slots_free():
    w = fleetllm_worker(max_num_seqs=8, running=5, inflight=5)
    limits = FlowLimits(headroom=0.25, share_window_s=0)
    assert (worker_room(w, limits), worker_room(w, limits, bulk=True)) == (3, 1)


@pytest.mark.parametrize(("policy", "room_for_others"), [("priority", 6), ("fcfs", 0)])
def test_work_that_is_not_bulk_finds_room_in_the_bulk_slots_of_a_worker_under_priority_scheduling(policy,
                                                                                                 room_for_others):
    # 8 slots full: 6 of this router's requests are bulk (the worker serves them a level less urgent), 2 are not
    w = fleetllm_worker(max_num_seqs=8, inflight=8, bulk_inflight=6, scheduling_policy=policy)
    limits = FlowLimits(worker_queue=0, headroom=0.25)
    assert (worker_room(w, limits), worker_room(w, limits, bulk=True)) == (room_for_others, 0)


@pytest.mark.parametrize(("policy", "flag", "depth"), [("priority", None, 1), ("fcfs", None, 0), ("priority", 0, 0),
                                                    ("fcfs", 2, 2)])
def test_a_worker_under_priority_scheduling_holds_one_request_waiting_unless_told_otherwise(policy, flag, depth):
    w = fleetllm_worker(max_num_seqs=8, inflight=8, scheduling_policy=policy)  # every slot taken
    assert worker_room(w, FlowLimits(worker_queue=flag, headroom=0)) == depth


def test_a_worker_under_priority_scheduling_keeps_no_headroom_from_bulk_work():
    w = fleetllm_worker(max_num_seqs=8, running=5, inflight=5, scheduling_policy="priority")
    limits = FlowLimits(worker_queue=0, headroom=0.25, share_window_s=0)
    assert worker_room(w, limits, bulk=True) == 3


def test_an_arrival_that_may_go_past_a_held_queue_is_let_through_without_waiting_a_turn_of_the_event_loop():
    async def run() -> tuple[bool, int]:
        w = fleetllm_worker(max_num_seqs=4)  # headroom: one slot
        flow = FlowControl(FlowLimits(headroom=0.25, share_window_s=0), TenantMetrics(CollectorRegistry()))
        a, b = Tenant("a"), Tenant("b")
        held = [await flow.admit("m", lambda: [w], a, "normal", 5.0) for _ in range(3)]
        for t in held:
            t.dispatched()
        w.inflight = 3
        flooding = asyncio.create_task(flow.admit("m", lambda: [w], a, "normal", 5.0))  # bulk: held
        await asyncio.sleep(0.01)
        arrival = flow.admit("m", lambda: [w], b, "normal", 5.0)
        try:
            arrival.send(None)
            suspended = True
        except StopIteration as done:
            suspended = False
            done.value.finished()
        flooding.cancel()
        await asyncio.gather(flooding, return_exceptions=True)
        await flow.close()
        return suspended, len(flow.gates["m"].queue)

    assert asyncio.run(run()) == (False, 0)


def test_a_tenant_holding_its_share_of_the_slots_waits_while_a_light_tenants_later_request_takes_the_headroom():
    async def run() -> tuple[bool, int, int]:
        w = fleetllm_worker(max_num_seqs=4)  # headroom: one slot
        # the share judged at once (no averaging over time)
        flow = FlowControl(FlowLimits(headroom=0.25, share_window_s=0), TenantMetrics(CollectorRegistry()))
        a, b = Tenant("a"), Tenant("b")
        held = [await flow.admit("m", lambda: [w], a, "normal", 5.0) for _ in range(3)]  # a holds 3 of 4 slots
        for t in held:
            t.dispatched()
        w.inflight = 3
        flooding = asyncio.create_task(flow.admit("m", lambda: [w], a, "normal", 5.0))
        await asyncio.sleep(0.05)
        light = await asyncio.wait_for(flow.admit("m", lambda: [w], b, "normal", 5.0), 1.0)
        a_waits, queued = not flooding.done(), len(flow.gates["m"].queue)
        light.finished()
        held[0].finished()
        w.inflight = 2
        flow.kick()
        (await asyncio.wait_for(flooding, 1.0)).finished()
        await flow.close()
        return a_waits, queued, flow.gates["m"].holding.get("a", 0)

    assert asyncio.run(run()) == (True, 1, 2)


def test_a_burst_of_a_tenant_under_its_share_is_not_bulk_while_a_tenant_holding_its_share_for_seconds_is():
    now = [0.0]
    gate = Gate(FlowLimits(share_window_s=2.0), lambda: [fleetllm_worker(max_num_seqs=8)], lambda: now[0])
    gate.weights = {"steady": 1.0, "bursty": 1.0}  # a share of 4 slots each
    for _ in range(4):
        gate.hold("steady", +1)
    now[0] = 10.0
    for _ in range(4):  # all at once, after holding nothing
        gate.hold("bursty", +1)
    assert (gate.bulk(Tenant("steady"), 1), gate.bulk(Tenant("bursty"), 1)) == (True, False)


def test_the_low_band_is_bulk_even_for_a_tenant_holding_nothing():
    async def run() -> bool:
        w = fleetllm_worker(max_num_seqs=4, inflight=3)
        flow = FlowControl(FlowLimits(headroom=0.25), TenantMetrics(CollectorRegistry()))
        batch = asyncio.create_task(flow.admit("m", lambda: [w], Tenant("batch"), "low", 5.0))
        await asyncio.sleep(0.05)
        waits = not batch.done()
        batch.cancel()
        await asyncio.gather(batch, return_exceptions=True)
        await flow.close()
        return waits

    assert asyncio.run(run()) is True


def test_routers_sharing_a_store_count_a_tenants_slots_through_both_so_it_is_bulk_at_its_share_not_twice(redis_server):
    async def run() -> tuple[bool, bool, bool, dict]:
        w = fleetllm_worker(max_num_seqs=8)  # a's share beside one newcomer: 4 slots
        flows = [FlowControl(FlowLimits(share_window_s=0), TenantMetrics(CollectorRegistry())) for _ in range(2)]
        shared = [SharedFlow(redis_server.url, f"test-{id(flows)}") for _ in flows]
        held = [await flows[0].admit("m", lambda: [w], Tenant("a"), "normal", 5.0) for _ in range(4)]
        gate = Gate(flows[1].limits, lambda: [w])
        alone = gate.bulk(Tenant("a"), 1)  # this router's own count: a holds nothing here
        await shared[0].sync(flows[0].gates)
        await shared[1].sync({"m": gate})
        together, other_tenant = gate.bulk(Tenant("a"), 1), gate.bulk(Tenant("b"), 1)
        for t in held:
            t.finished()
        for s in shared:
            await s.close()
        return alone, together, other_tenant, gate.others

    assert asyncio.run(run()) == (False, True, False, {"a": (4, 1.0)})


def test_an_unreachable_store_leaves_each_router_counting_its_own_tenants():
    async def run() -> dict:
        gate = Gate(FlowLimits(), lambda: [])
        gate.others = {"a": (4, 1.0)}
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            shared = SharedFlow(f"redis://127.0.0.1:{s.getsockname()[1]}", "test")
            await shared.tick({"m": gate})
        await shared.close()
        return gate.others

    assert asyncio.run(run()) == {}
