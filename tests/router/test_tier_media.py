"""Blocks a worker reports in a KV tier (host memory, disk): decoded with their medium, indexed apart from
the pool, and priced by ``kv_aware`` as a load — cheaper than recomputing, dearer than a pool hit."""

from __future__ import annotations

from fleetllm.router.backends.vllm_events import apply_event
from fleetllm.router.backends.vllm_hash import external_hash
from fleetllm.router.backends.vllm_wire import decode_batch, encode_batch, removed_event, stored_event
from fleetllm.router.index import POOL, PrefixIndex
from fleetllm.router.policies import CostModel, PrefixAware, RouteRequest
from fleetllm.router.upstream import WorkerState

BLOCK = 16
PREFIX = [11, 12, 13, 14]  # a 4-block prompt's chained hashes


def _apply(index: PrefixIndex, worker: str, *events: dict) -> None:
    _, decoded = decode_batch(encode_batch(0.0, list(events)))
    for ev in decoded:
        apply_event(index, worker, ev)


def test_a_stored_event_with_a_medium_is_decoded_and_indexed_as_that_tier() -> None:
    idx = PrefixIndex(routed_ttl_s=0)
    _apply(idx, "w", stored_event([1, 2], None, list(range(2 * BLOCK)), BLOCK, medium="CPU"))
    h1, h2 = external_hash(1), external_hash(2)
    _, (ev,) = decode_batch(encode_batch(0.0, [stored_event([1], None, [0] * BLOCK, BLOCK, medium="DISK")]))
    assert ev.medium == "DISK"
    assert idx.match([h1, h2], ["w"]) == {"w": 0}  # not in the pool
    assert idx.match_media([h1, h2], ["w"]) == {"w": ["CPU", "CPU"]}


def test_a_tier_removal_leaves_the_pool_entry_and_a_pool_removal_leaves_the_tier_entry() -> None:
    idx = PrefixIndex(routed_ttl_s=0)
    tokens = list(range(2 * BLOCK))
    _apply(idx, "w", stored_event([1], None, tokens[:BLOCK], BLOCK),
           stored_event([1, 2], None, tokens, BLOCK, medium="DISK"), removed_event([1], medium="DISK"))
    h1, h2 = external_hash(1), external_hash(2)
    assert idx.match_media([h1, h2], ["w"]) == {"w": [POOL, "DISK"]}
    _apply(idx, "w", removed_event([1]))
    assert idx.match_media([h1, h2], ["w"]) == {"w": []}  # block 1 held nowhere: the chain stops there


def test_the_cheapest_tier_holding_a_block_is_the_one_it_would_load_from() -> None:
    idx = PrefixIndex(routed_ttl_s=0)
    idx.stored("w", [1], "DISK")
    idx.stored("w", [1], "CPU")
    assert idx.match_media([1], ["w"], CostModel().load_fraction) == {"w": ["CPU"]}


def _choose(media: dict[str, str | None], measured: dict[str, dict[str, float]] | None = None) -> str:
    """The worker kv_aware picks among idle ones, each holding the whole prefix in ``media[w]`` (None: cold), each
    having measured its tiers' load seconds a block as ``measured[w]`` says (none: not yet)."""
    idx = PrefixIndex(routed_ttl_s=0)
    ws = []
    for name, medium in media.items():
        ws.append(WorkerState(name, f"http://{name}", healthy=True))
        ws[-1].block_size = BLOCK
        ws[-1].tier_load_s = (measured or {}).get(name, {})
        if medium is not None:
            idx.stored(name, PREFIX, medium)
    req = RouteRequest(num_prompt_tokens=len(PREFIX) * BLOCK + 8, block_hashes=PREFIX, block_size=BLOCK)
    return PrefixAware("kv_aware", idx, CostModel(), seed=0).choose(req, ws).worker.name


def test_kv_aware_prefers_a_worker_whose_host_or_disk_tier_holds_the_prefix_over_a_cold_one() -> None:
    assert _choose({"cold": None, "host": "CPU"}) == "host"
    assert _choose({"cold": None, "disk": "DISK"}) == "disk"


def test_kv_aware_prefers_the_pool_over_host_memory_over_disk() -> None:
    assert _choose({"disk": "DISK", "host": "CPU", "pool": "GPU"}) == "pool"
    assert _choose({"disk": "DISK", "host": "CPU"}) == "host"


def test_a_tier_load_is_priced_as_its_fraction_of_recomputing_the_blocks() -> None:
    cost, w = CostModel(tier_load={"CPU": 0.25}), WorkerState("w", "http://w", healthy=True)
    idx = PrefixIndex(routed_ttl_s=0)
    idx.stored("w", PREFIX, "CPU")
    media = idx.match_media(PREFIX, ["w"], cost.load_fraction)["w"]
    loaded = BLOCK * sum(cost.load_fraction(m) for m in media)
    assert cost.cost(w, loaded) == cost.cost(w, 0.25 * len(PREFIX) * BLOCK)
    assert cost.load_fraction("NVME") == 1.0  # a medium the router has no price for is a miss


def test_kv_tier_load_flag_reprices_a_tier_and_a_bad_fraction_is_one_usage_line(capsys) -> None:
    from fleetllm.cli import build_parser, main, router_config

    args = build_parser().parse_args(["router", "--workers", "http://127.0.0.1:1", "--kv-tier-load", "disk=0.4"])
    assert router_config(args).cost.tier_load == {"CPU": 0.05, "DISK": 0.4, "SHARED": 0.25}
    assert main(["router", "--workers", "http://127.0.0.1:1", "--kv-tier-load", "DISK=lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--kv-tier-load DISK=lots" in err


def test_a_workers_measured_tier_load_time_replaces_the_fraction_in_its_price() -> None:
    recompute_s = CostModel().prefill_s(BLOCK)
    assert _choose({"cold": None, "host": "CPU"}, {"host": {"CPU": 2 * recompute_s}}) == "cold"  # slower than computing
    assert _choose({"a": "DISK", "b": "DISK"}, {"a": {"DISK": 0.9 * recompute_s}, "b": {"DISK": 0.1 * recompute_s}}) == "b"
    w = WorkerState("w", "http://w", healthy=True)
    assert CostModel().tier_block_s(w, "CPU", BLOCK) == 0.05 * recompute_s  # nothing measured: the fraction
    assert CostModel().tier_block_s(w, POOL, BLOCK) == 0.0


def test_a_load_report_carries_the_tiers_measured_load_time_to_the_worker_state() -> None:
    from fleetllm.router.upstream import WorkerMonitor

    w = WorkerState("w", "http://w", healthy=True)
    monitor = WorkerMonitor([w], PrefixIndex(routed_ttl_s=0), client=None)  # type: ignore[arg-type]
    monitor._apply(w, {"type": "load", "running": 0, "waiting": 0, "kv_usage": 0.1, "tier_load_s": {"cpu": 0.0004}})
    assert w.tier_load_s == {"CPU": 0.0004}
    monitor._apply(w, {"type": "load", "running": 0, "waiting": 0, "kv_usage": 0.1})  # an older worker: none measured
    assert w.tier_load_s == {}
