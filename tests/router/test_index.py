"""The router's prefix index: prefix matching, expiry, capacity, events and restarts."""

from __future__ import annotations

from fleetllm.router.index import PrefixIndex
from fleetllm.router.upstream import Breaker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_match_counts_leading_blocks_only():
    idx = PrefixIndex(routed_ttl_s=10)
    idx.record_routed("a", [1, 2, 3])
    idx.record_routed("b", [2, 3])  # holds later blocks but not the first: no prefix
    assert idx.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 0, "c": 0}


def test_routed_entries_expire_after_their_ttl():
    clock = Clock()
    idx = PrefixIndex(routed_ttl_s=10, clock=clock)
    idx.record_routed("a", [1, 2])
    clock.t = 9.9
    assert idx.match([1, 2], ["a"]) == {"a": 2}
    clock.t = 10.1
    assert idx.match([1, 2], ["a"]) == {"a": 0}


def test_routed_entries_are_bounded_by_the_workers_pool_size():
    idx = PrefixIndex(routed_ttl_s=100)
    idx.reset("a", [], capacity=4)
    idx.record_routed("a", [1, 2, 3])
    idx.record_routed("a", [4, 5, 6])  # oldest routed hashes leave first
    assert idx.match([1], ["a"]) == {"a": 0}
    assert idx.match([4, 5, 6], ["a"]) == {"a": 3}


def test_events_add_and_remove_exact_entries_and_removal_kills_routed_hints():
    idx = PrefixIndex(routed_ttl_s=100)
    idx.reset("a", [1])
    idx.stored("a", [2])
    idx.record_routed("a", [3])
    assert idx.match([1, 2, 3], ["a"]) == {"a": 3}
    idx.removed("a", [2, 3])
    assert idx.match([1, 2, 3], ["a"]) == {"a": 1}


def test_a_restart_snapshot_replaces_everything_the_worker_had():
    idx = PrefixIndex(routed_ttl_s=0)
    idx.reset("a", [1, 2, 3])
    idx.reset("a", [])  # the restarted worker's snapshot: empty cache
    assert idx.match([1], ["a"]) == {"a": 0}
    idx.stored("a", [1])
    assert idx.match([1], ["a"]) == {"a": 1}


def test_drop_forgets_a_dead_worker():
    idx = PrefixIndex(routed_ttl_s=100)
    idx.reset("a", [1])
    idx.record_routed("a", [1, 2])
    idx.drop("a")
    assert idx.size("a") == 0 and idx.match([1], ["a"]) == {"a": 0}


def test_breaker_opens_after_threshold_failures_and_probes_once_after_cooldown():
    b = Breaker(threshold=3, cooldown_s=5)
    assert not b.failure(0) and not b.failure(0)
    assert b.failure(0) and b.state == "open" and b.trips == 1
    assert not b.allows(4.9)
    assert b.allows(5.0) and b.state == "half_open"
    b.on_dispatch()
    assert not b.allows(5.1)  # one probe at a time
    assert b.failure(5.2) and b.state == "open" and b.trips == 2  # the probe failed: open again
    assert b.allows(10.3)
    b.on_dispatch()
    b.success()
    assert b.state == "closed" and b.allows(10.4)
