"""The admission stage's queue (no HTTP): bands in order with ageing, weighted fair queuing between tenants,
and which request a full queue sheds."""

from __future__ import annotations

import collections

from fleetllm.router.pipeline.fair_queue import BANDS, Entry, FairQueue

HIGH, NORMAL, LOW = (BANDS.index(b) for b in ("high", "normal", "low"))


def drain(q: FairQueue, now: float = 0.0) -> list[str]:
    out = []
    while (e := q.pop(now)) is not None:
        out.append(e.payload)
    return out


def push(q: FairQueue, tenant: str, n: int, weight: float = 1.0, band: int = NORMAL, at: float = 0.0) -> None:
    for i in range(n):
        assert q.push(Entry(tenant, band, at, payload=f"{tenant}{i}"), weight) is None


def test_tenants_of_a_band_are_released_in_proportion_to_their_weights():
    q = FairQueue(limit=1000, aging_s=0)
    push(q, "a", 40, weight=1)
    push(q, "b", 40, weight=3)
    first = collections.Counter(p[0] for p in drain(q)[:20])
    assert first == {"b": 15, "a": 5}


def test_a_flooding_tenant_does_not_delay_one_that_arrives_after_it():
    q = FairQueue(limit=1000, aging_s=0)
    push(q, "flood", 10)
    push(q, "quiet", 2)
    assert drain(q)[:5] == ["flood0", "quiet0", "flood1", "quiet1", "flood2"]


def test_a_tenant_back_from_idling_gets_its_share_from_now_not_a_saved_up_burst():
    q = FairQueue(limit=1000, aging_s=0)
    push(q, "busy", 6)
    assert [q.pop(0.0).payload for _ in range(4)] == ["busy0", "busy1", "busy2", "busy3"]
    push(q, "idle", 3)
    assert drain(q) == ["busy4", "idle0", "busy5", "idle1", "idle2"]


def test_the_highest_band_goes_first_whatever_the_arrival_order():
    q = FairQueue(limit=1000, aging_s=0)
    push(q, "batch", 2, band=LOW)
    push(q, "web", 1, band=NORMAL)
    push(q, "urgent", 1, band=HIGH)
    assert drain(q) == ["urgent0", "web0", "batch0", "batch1"]


def test_a_waiting_low_band_climbs_one_band_per_ageing_period():
    q = FairQueue(limit=1000, aging_s=10.0)
    push(q, "batch", 1, band=LOW, at=0.0)
    push(q, "web", 2, band=NORMAL, at=9.0)
    assert q.pop(now=9.5).payload == "web0"  # waited 9.5 s: still below the normal band
    assert q.pop(now=10.5).payload == "batch0"  # one period: level with normal, and older
    assert drain(q, 10.5) == ["web1"]


def test_a_full_queue_sheds_the_newest_request_of_the_lowest_band_for_a_more_urgent_one():
    q = FairQueue(limit=3, aging_s=0)
    push(q, "batch", 2, band=LOW)
    push(q, "web", 1, band=NORMAL)
    urgent = Entry("ops", HIGH, 0.0, payload="ops0")
    shed = q.push(urgent, 1.0)
    assert shed is not None and shed.payload == "batch1"
    assert drain(q) == ["ops0", "web0", "batch0"]


def test_a_full_queue_refuses_an_arrival_with_nothing_below_its_band():
    q = FairQueue(limit=2, aging_s=0)
    push(q, "web", 2, band=NORMAL)
    late = Entry("batch", LOW, 0.0, payload="batch0")
    assert q.push(late, 1.0) is late
    assert q.push(Entry("web", NORMAL, 0.0), 1.0) is not None and len(q) == 2


def test_a_removed_request_is_never_released():
    q = FairQueue(limit=10, aging_s=0)
    gone = Entry("a", NORMAL, 0.0, payload="gone")
    q.push(gone, 1.0)
    push(q, "a", 1)
    assert q.remove(gone) and not q.remove(gone)
    assert drain(q) == ["a0"] and q.depth() == {}
