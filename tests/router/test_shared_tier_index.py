"""The shared KV tier in the router's index: a block one worker reports in the shared tier (medium ``SHARED``)
is a load for every worker of its scope (the KV layout its snapshot names), outlives the worker that reported
it, and makes ``kv_aware`` send a returning session to any idle copy rather than to a cold one."""

from __future__ import annotations

from fleetllm.router.index import SHARED, SHARED_BLOCKS, PrefixIndex
from fleetllm.router.policies import CostModel, PrefixAware, RouteRequest
from fleetllm.router.upstream import WorkerMonitor, WorkerState

BLOCK = 16
PREFIX = [11, 12, 13, 14]


def _index(scopes: dict[str, str]) -> PrefixIndex:
    idx = PrefixIndex(routed_ttl_s=0)
    for worker, scope in scopes.items():
        idx.set_scope(worker, scope)
    return idx


def test_a_shared_block_one_worker_reported_is_a_load_for_every_worker_of_its_scope_only() -> None:
    idx = _index({"a": "ns1", "b": "ns1", "c": "ns2"})
    idx.stored("a", PREFIX, SHARED)
    assert idx.match_media(PREFIX, ["a", "b", "c"]) == {"a": [SHARED] * 4, "b": [SHARED] * 4, "c": []}


def test_shared_blocks_outlive_the_worker_that_reported_them_and_leave_when_one_finds_them_gone() -> None:
    idx = _index({"a": "ns1", "b": "ns1"})
    idx.stored("a", PREFIX, SHARED)
    idx.drop("a")  # its stream broke, or it restarted: the store still holds the blocks
    assert idx.match_media(PREFIX, ["b"]) == {"b": [SHARED] * 4}
    idx.removed("b", PREFIX[2:3], SHARED)  # b looked block 13 up and the store had lost it
    assert idx.match_media(PREFIX, ["b"]) == {"b": [SHARED] * 2}


def test_a_scope_keeps_its_most_recent_shared_blocks() -> None:
    idx = _index({"a": "ns1"})
    idx.stored("a", range(SHARED_BLOCKS + 2), SHARED)
    assert len(idx.shared["ns1"]) == SHARED_BLOCKS
    assert idx.match_media([0], ["a"]) == {"a": []} and idx.match_media([SHARED_BLOCKS + 1], ["a"]) == {"a": [SHARED]}


def test_a_shared_block_from_a_worker_without_a_scope_is_its_own_tier() -> None:
    idx = PrefixIndex(routed_ttl_s=0)  # a vLLM-format publisher names no layout
    idx.stored("a", PREFIX, SHARED)
    assert idx.match_media(PREFIX, ["a", "b"]) == {"a": [SHARED] * 4, "b": []}


def test_kv_aware_sends_a_prompt_whose_prefix_is_shared_to_an_idle_copy_over_a_cold_one() -> None:
    idx = _index({"writer": "ns1", "copy": "ns1", "cold": "ns2"})
    idx.stored("writer", PREFIX, SHARED)
    ws = [WorkerState(name, f"http://{name}", healthy=True) for name in ("copy", "cold")]
    for w in ws:
        w.block_size = BLOCK
    req = RouteRequest(num_prompt_tokens=len(PREFIX) * BLOCK + 8, block_hashes=PREFIX, block_size=BLOCK)
    for seed in range(5):  # not a tie broken by chance
        assert PrefixAware("kv_aware", idx, CostModel(), seed=seed).choose(req, ws).worker.name == "copy"


def test_a_workers_snapshot_indexes_its_tiers_blocks_and_scopes_its_shared_ones() -> None:
    a, b = WorkerState("a", "http://a", healthy=True), WorkerState("b", "http://b", healthy=True)
    idx = PrefixIndex(routed_ttl_s=0)
    monitor = WorkerMonitor([a, b], idx, client=None)  # type: ignore[arg-type]
    for w in (a, b):
        monitor._apply(w, {"type": "snapshot", "instance": w.name, "model": "m", "block_size": BLOCK,
                           "num_blocks": 8, "hashes": [], "kv_namespace": "ns1",
                           "tiers": {"DISK": PREFIX[:2], SHARED: PREFIX} if w is a else {}})
    assert idx.match_media(PREFIX, ["a", "b"], CostModel().load_fraction) == {
        "a": ["DISK", "DISK", SHARED, SHARED], "b": [SHARED] * 4}
    monitor._apply(b, {"type": "removed", "hashes": PREFIX[3:], "medium": SHARED})
    assert idx.match_media(PREFIX, ["a"]) == {"a": ["DISK", "DISK", SHARED]}
