"""--scheduling-policy priority: admission by (aged) priority, and the worst-ranked running request preempted
first under KV pressure. The scheduler alone, over a tiny block pool: no model, no timing."""

from __future__ import annotations

import pytest

from fleetllm.engine.block_pool import BlockPool
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.params import SamplingParams
from fleetllm.engine.scheduler import Scheduler, SchedulerConfig
from fleetllm.engine.sequence import Sequence, Status

BS = 4


def scheduler(policy: str, num_blocks: int = 16, max_num_seqs: int = 8, aging_s: float = 1.0,
              urgent_step_rows: int | None = None) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, BS), enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs, 256, watermark=0.0, policy=policy, priority_aging_s=aging_s,
                                     urgent_step_rows=urgent_step_rows), kv)


def seq(rid: str, priority: int, arrival: float, first_token: int = 1) -> Sequence:
    s = Sequence(rid, [first_token + i for i in range(BS)], SamplingParams(max_tokens=8, priority=priority), 8)
    s.arrival_time = arrival
    return s


def run_step(sched: Scheduler) -> list[str]:
    """One step as the engine runs it: every scheduled sequence computes its tokens and emits one; returns
    the ids scheduled."""
    out = sched.schedule()
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.append_output(7, 0.0)
    return [s.seq.request_id for s in out.scheduled]


def test_priority_admits_the_most_urgent_waiting_request_first():
    sched = scheduler("priority", max_num_seqs=1)
    for rid, prio, t in [("late-batch", 5, 1.0), ("urgent", -5, 3.0), ("normal", 0, 2.0)]:
        sched.add(seq(rid, prio, t))
    assert run_step(sched) == ["urgent"]
    assert [s.request_id for s in sched.waiting] == ["normal", "late-batch"]


def test_equal_priorities_are_admitted_in_arrival_order():
    sched = scheduler("priority", max_num_seqs=1)
    sched.add(seq("second", 0, 2.0))
    sched.add(seq("first", 0, 1.0))
    assert run_step(sched) == ["first"]


def test_fcfs_ignores_priority():
    sched = scheduler("fcfs", max_num_seqs=1)
    sched.add(seq("first", 9, 1.0))
    sched.add(seq("urgent", -9, 2.0))
    assert run_step(sched) == ["first"]


def test_ageing_lets_a_long_waiting_request_pass_a_fresh_urgent_one():
    # priority 3 arriving at t=0 ranks like priority 0 at t=3 (one level per second): before priority 0 at t=10
    sched = scheduler("priority", max_num_seqs=1, aging_s=1.0)
    sched.add(seq("fresh", 0, 10.0))
    sched.add(seq("aged", 3, 0.0))
    assert run_step(sched) == ["aged"]


def test_without_ageing_priority_alone_decides():
    sched = scheduler("priority", max_num_seqs=1, aging_s=0.0)
    sched.add(seq("fresh", 0, 10.0))
    sched.add(seq("aged", 3, 0.0))
    assert run_step(sched) == ["fresh"]


@pytest.mark.parametrize(("policy", "victim"), [("priority", "old-batch"), ("fcfs", "new-urgent")])
def test_under_kv_pressure_priority_preempts_the_lowest_priority_and_fcfs_the_newest(policy, victim):
    # 3 blocks: both one-block prompts run; each then needs a second block and only one is left
    sched = scheduler(policy, num_blocks=3)
    sched.add(seq("old-batch", 10, 1.0, first_token=1))
    sched.add(seq("new-urgent", -10, 2.0, first_token=50))
    assert sorted(run_step(sched)) == ["new-urgent", "old-batch"]
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == [victim]
    assert sched.waiting[0].request_id == victim and sched.waiting[0].status is Status.PREEMPTED
    assert [s.seq.request_id for s in out.scheduled] == [({"old-batch", "new-urgent"} - {victim}).pop()]


def test_a_preempted_request_waits_behind_more_urgent_ones_and_ahead_of_less_urgent():
    sched = scheduler("priority", num_blocks=3)
    sched.add(seq("batch", 10, 1.0, first_token=1))
    sched.add(seq("urgent", -10, 2.0, first_token=50))
    run_step(sched)
    sched.add(seq("later-batch", 20, 3.0, first_token=90))
    sched.add(seq("later-urgent", -20, 4.0, first_token=120))
    sched.schedule()  # preempts "batch"
    assert [s.request_id for s in sched.waiting] == ["later-urgent", "batch", "later-batch"]


def test_a_more_urgent_request_takes_the_batch_slot_of_the_least_urgent_running_one():
    sched = scheduler("priority", max_num_seqs=2)
    sched.add(seq("bulk", 1, 1.0, first_token=1))
    sched.add(seq("bulker", 2, 1.0, first_token=20))
    run_step(sched)
    sched.add(seq("urgent", 0, 1.5, first_token=50))
    out = sched.schedule()
    assert [s.request_id for s in out.displaced] == ["bulker"] and out.preempted == []
    assert sorted(s.seq.request_id for s in out.scheduled) == ["bulk", "urgent"]
    assert sched.waiting[0].request_id == "bulker" and sched.waiting[0].status is Status.PREEMPTED


def test_a_burst_of_urgent_arrivals_takes_the_slots_of_as_many_bulk_rows_in_one_step():
    sched = scheduler("priority", max_num_seqs=3)
    for i, rid in enumerate(["bulk", "bulker", "bulkest"]):
        sched.add(seq(rid, 1 + i, 1.0, first_token=1 + 20 * i))
    run_step(sched)
    sched.add(seq("urgent", 0, 1.5, first_token=70))
    sched.add(seq("urgent-too", 0, 1.6, first_token=90))
    out = sched.schedule()
    assert [s.request_id for s in out.displaced] == ["bulkest", "bulker"] and out.preempted == []
    assert sorted(s.seq.request_id for s in out.scheduled) == ["bulk", "urgent", "urgent-too"]
    assert [s.request_id for s in sched.waiting] == ["bulker", "bulkest"]


@pytest.mark.parametrize(("policy", "priority", "arrival"),
                         [("fcfs", -5, 1.5), ("priority", 1, 1.5), ("priority", 0, 5.0)])
def test_a_waiting_request_displaces_nobody_unless_more_urgent_and_still_ranked_first(policy, priority, arrival):
    # fcfs never displaces; nor does a peer of the running requests' priority; nor an urgent request the running
    # one has out-aged (priority 1 at t=1 ranks like priority 0 at t=2, before priority 0 at t=5)
    sched = scheduler(policy, max_num_seqs=1)
    sched.add(seq("running", 1, 1.0))
    run_step(sched)
    sched.add(seq("waiting", priority, arrival, first_token=50))
    out = sched.schedule()
    assert out.displaced == [] and [s.seq.request_id for s in out.scheduled] == ["running"]


def decoding(sched: Scheduler, rows: list[tuple[str, int]]) -> None:
    """``rows`` (id, priority) running, past their first token."""
    for i, (rid, priority) in enumerate(rows):
        sched.add(seq(rid, priority, 1.0 + i, first_token=10 * i + 1))
    run_step(sched)


@pytest.mark.parametrize(("limit", "carried"), [(0, []), (1, ["bulk-a"]), (5, ["bulk-a", "bulk-b"])])
def test_an_urgent_first_token_step_carries_at_most_urgent_step_rows_less_urgent_rows(limit, carried):
    sched = scheduler("priority", urgent_step_rows=limit)
    decoding(sched, [("bulk-a", 1), ("bulk-b", 2), ("peer", 0)])
    sched.add(seq("urgent", 0, 5.0, first_token=90))
    assert sorted(run_step(sched)) == sorted(["urgent", "peer", *carried])
    assert sorted(run_step(sched)) == ["bulk-a", "bulk-b", "peer", "urgent"]  # the next step carries every row


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_urgent_step_rows_holds_back_nothing_when_all_requests_share_one_priority(policy):
    sched = scheduler(policy, urgent_step_rows=0)
    decoding(sched, [("a", 0), ("b", 0)])
    sched.add(seq("new", 0, 5.0, first_token=90))
    assert sorted(run_step(sched)) == ["a", "b", "new"]


def test_a_row_held_back_for_an_urgent_first_token_is_carried_in_the_next_step_whatever_arrives():
    sched = scheduler("priority", urgent_step_rows=0)
    decoding(sched, [("bulk", 1)])
    sched.add(seq("urgent", 0, 5.0, first_token=90))
    assert run_step(sched) == ["urgent"]
    sched.add(seq("urgent-2", 0, 6.0, first_token=130))
    assert sorted(run_step(sched)) == ["bulk", "urgent", "urgent-2"]


def test_a_less_urgent_request_waits_to_be_admitted_until_the_step_after_an_urgent_first_token():
    sched = scheduler("priority", urgent_step_rows=0)
    sched.add(seq("urgent", 0, 5.0, first_token=90))
    sched.add(seq("bulk", 1, 5.5))  # ranks after "urgent" (priority 1 at 5.5 ranks like priority 0 at 6.5)
    assert run_step(sched) == ["urgent"]
    assert sorted(run_step(sched)) == ["bulk", "urgent"]


def test_a_first_token_of_the_low_band_holds_back_no_less_urgent_rows():
    sched = scheduler("priority", urgent_step_rows=0)
    decoding(sched, [("batch", 2)])
    sched.add(seq("bulk", 1, 5.0, first_token=90))
    assert sorted(run_step(sched)) == ["batch", "bulk"]


@pytest.mark.parametrize(("max_num_seqs", "extra"), [(2, 1), (8, 2)])
def test_a_paused_step_admits_urgent_arrivals_into_a_quarter_more_slots_preempting_nothing(max_num_seqs, extra):
    sched = scheduler("priority", num_blocks=32, max_num_seqs=max_num_seqs, urgent_step_rows=0)
    decoding(sched, [(f"bulk-{i}", 1) for i in range(max_num_seqs)])
    for i in range(extra + 1):
        sched.add(seq(f"urgent-{i}", 0, 20.0 + i, first_token=90 + 40 * i))
    out = sched.schedule_urgent(guard=1.5)  # the paused step: the bulk rows decoding
    assert [s.seq.request_id for s in out.scheduled] == [f"urgent-{i}" for i in range(extra)]
    assert out.preempted == out.displaced == [] and len(sched.running) == max_num_seqs + extra
    assert [s.request_id for s in sched.waiting] == [f"urgent-{extra}"]


def test_an_urgent_arrival_left_out_of_the_extra_slots_takes_a_slot_at_the_next_step():
    # the batch is over max_num_seqs with urgent rows a paused step admitted: the next one displaces bulk rows
    # until it is back under, and the urgent arrival left waiting starts then
    sched = scheduler("priority", num_blocks=32, max_num_seqs=2, urgent_step_rows=None)
    decoding(sched, [("bulk-0", 1), ("bulk-1", 2)])
    sched.add(seq("urgent-0", 0, 1.2, first_token=90))
    sched.add(seq("urgent-1", 0, 1.3, first_token=130))
    assert [s.seq.request_id for s in sched.schedule_urgent(guard=1.5).scheduled] == ["urgent-0"]
    out = sched.schedule()
    assert [s.request_id for s in out.displaced] == ["bulk-1", "bulk-0"] and out.preempted == []
    assert sorted(s.seq.request_id for s in out.scheduled) == ["urgent-0", "urgent-1"]


@pytest.mark.parametrize(("priority", "guard"), [(1, 1.5), (0, 0.0), (0, -0.5)])
def test_a_paused_step_admits_no_arrival_as_urgent_as_its_rows_nor_of_the_low_band(priority, guard):
    sched = scheduler("priority", urgent_step_rows=0)
    sched.add(seq("arrival", priority, 5.0))
    assert sched.schedule_urgent(guard).scheduled == [] and [s.request_id for s in sched.waiting] == ["arrival"]
