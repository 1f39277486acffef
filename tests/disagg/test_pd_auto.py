"""--pd-threshold auto: the per-request decision from its estimates, what the router learns from remote
prefills, and the router's P/D path deciding with them (an in-process router side over a mock prefill worker)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import pytest

from fleetllm.cli import build_parser
from fleetllm.disagg.pd_auto import ArrivalRates, PdEstimate, PdMeasurements, pd_threshold_value
from fleetllm.disagg.router_path import RemotePrefill
from fleetllm.router.config import RouterConfig
from fleetllm.router.forward import Forward
from fleetllm.router.index import PrefixIndex
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.policies import Decision, RouteRequest
from fleetllm.router.upstream import WorkerState

# a 1,600-token prompt on CPU-like rates: 1 s to prefill at 1,600 tokens/s
BUSY = PdEstimate(uncached_tokens=1600, prefill_tokens=1600, decode_batch=3, decode_rate=1600.0,
                  prefill_rate=1600.0, decode_queue_s=0.0, prefill_queue_s=0.0, transfer_s=0.05)


def test_a_long_prompt_goes_remote_when_others_decode_on_its_worker_and_the_transfer_is_cheap():
    assert BUSY.stall_s == pytest.approx(3.0) and BUSY.remote_s == pytest.approx(3 * 0.05 + 0.05)
    assert BUSY.disaggregate


def test_nobody_decoding_on_the_decode_worker_means_nothing_to_spare_a_stall():
    assert not dataclasses.replace(BUSY, decode_batch=0).disaggregate


def test_requests_arriving_during_a_local_prefill_count_as_stalled_too():
    idle = dataclasses.replace(BUSY, decode_batch=0)
    arriving = dataclasses.replace(idle, arrival_rate=2.0)  # 2 requests/s wait behind 1 s of prefill: 1 s in all
    assert arriving.stall_s == pytest.approx(2.0 * 1.0**2 / 2)
    assert arriving.remote_s == pytest.approx(2.0 * 0.05**2 / 2 + 0.05)  # the import's stall, the longer TTFT
    assert arriving.disaggregate and not idle.disaggregate


def test_arrival_rates_read_a_steady_stream_and_forget_a_burst():
    rates = ArrivalRates(horizon_s=10.0)
    for i in range(400):  # 4 requests/s for 100 s
        rates.observe("d", i * 0.25)
    assert rates.rate("d", 100.0) == pytest.approx(4.0, rel=0.05) and rates.rate("p", 100.0) == 0.0
    assert rates.rate("d", 150.0) < 0.05  # nothing for 5 horizons


def test_a_transfer_slower_than_the_local_prefill_never_pays():
    assert not dataclasses.replace(BUSY, transfer_s=1.2).disaggregate


def test_a_prefill_worker_queued_far_behind_keeps_the_prefill_local():
    assert not dataclasses.replace(BUSY, decode_batch=1, prefill_queue_s=5.0).disaggregate
    assert dataclasses.replace(BUSY, decode_batch=1, prefill_queue_s=0.5).disaggregate


def test_a_queue_on_the_decode_worker_favours_the_remote_path():
    slow_remote = dataclasses.replace(BUSY, decode_batch=1, prefill_queue_s=3.0)
    assert not slow_remote.disaggregate
    assert dataclasses.replace(slow_remote, decode_queue_s=2.5).disaggregate


def test_the_remote_legs_fixed_overhead_counts_against_it():
    short = dataclasses.replace(BUSY, uncached_tokens=64, prefill_tokens=64, decode_batch=1, transfer_s=0.002)
    assert short.disaggregate and not dataclasses.replace(short, overhead_s=0.1).disaggregate


def test_a_prefill_worker_holding_the_document_computes_only_the_rest():
    held = dataclasses.replace(BUSY, decode_batch=1, prefill_queue_s=1.0, prefill_tokens=160)
    assert held.disaggregate and not dataclasses.replace(held, prefill_tokens=1600).disaggregate


def test_measurements_learn_rates_bytes_and_bandwidth_from_answers():
    m = PdMeasurements(default_rate=1000.0)
    assert m.rate("p") == 1000.0 and m.transfer_s(1000) == 0.0  # nothing measured: transfers count as free
    m.observe("p", 2000, {"prefill_s": 1.0, "transfer_s": 0.5, "bytes": 4_000_000, "prompt_tokens": 2000}, 1.6)
    assert m.rate("p") == 2000.0 and m.rate("d") == 2000.0  # an unmeasured worker of the fleet: the measured mean
    assert m.transfer_s(1000) == pytest.approx(0.25) and m.overhead_s == pytest.approx(0.1)
    m.observe("p", 100, {"prefill_s": 1.0, "transfer_s": 0.5, "bytes": 200_000, "prompt_tokens": 100}, 1.6)
    assert m.rate("p") == 2000.0  # too short to say anything about the rate


def test_the_threshold_flag_takes_a_count_or_auto():
    assert pd_threshold_value("auto") == "auto" and pd_threshold_value("1024") == 1024
    with pytest.raises(ValueError):
        pd_threshold_value("often")
    parser = build_parser()
    assert parser.parse_args(["router", "--pd-threshold", "auto"]).pd_threshold == "auto"
    assert parser.parse_args(["serve", "--pd-threshold", "2048"]).pd_threshold == 2048
    assert parser.parse_args(["router"]).pd_threshold == 4096


def _worker(name: str, role: str, **load: int) -> WorkerState:
    return WorkerState(name, f"http://{name}", role=role, healthy=True, **load)


def _router_side(prefill_answers: list[str]) -> tuple[RemotePrefill, RouterMetrics, PrefixIndex]:
    def answer(request: httpx.Request) -> httpx.Response:
        prefill_answers.append(request.url.host)
        return httpx.Response(200, json={"blocks": 100, "bytes": 1_600_000, "prompt_tokens": 1600, "prefill_s": 1.0,
                                         "transfer_s": 0.02, "imported": 100, "already_cached": 0})

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    metrics, index = RouterMetrics(), PrefixIndex(10.0)
    return RemotePrefill(client, RouterConfig(pd_threshold="auto"), metrics, index, lambda w: None), metrics, index


def _forward(route: RouteRequest) -> Forward:
    return Forward("/v1/completions", b"{}", {"prompt": "x"}, {}, "rid", route, 0.0)


def test_the_router_disaggregates_in_auto_mode_only_when_it_wins_and_from_the_prefill_worker_holding_the_prompt():
    asked: list[str] = []
    side, metrics, index = _router_side(asked)
    route = RouteRequest(num_prompt_tokens=1600, block_hashes=list(range(1, 101)))
    p1, p2 = _worker("p1", "prefill"), _worker("p2", "prefill")
    index.stored("p2", range(1, 101))  # p2 prefilled this document before
    idle, busy = _worker("d1", "decode"), _worker("d2", "decode", running=3, inflight=3, decoding=3)

    async def run() -> tuple[Decision, Decision]:
        local = await side.maybe_disaggregate(Decision(idle, "cold"), _forward(route), [p1, p2])
        remote = await side.maybe_disaggregate(Decision(busy, "cold"), _forward(route), [p1, p2])
        return local, remote

    local, remote = asyncio.run(run())
    assert local.cached_tokens == 0 and remote.cached_tokens == 1599  # all but the last token, as after a hit
    assert asked == ["p2"]
    assert metrics.pd_auto.labels(decision="local")._value.get() == 1
    assert metrics.pd_auto.labels(decision="disaggregated")._value.get() == 1
    assert side.measured.bandwidth == pytest.approx(80e6)


def test_the_router_counts_requests_arriving_at_an_idle_decode_worker():
    asked: list[str] = []
    side, metrics, _ = _router_side(asked)
    route = RouteRequest(num_prompt_tokens=1600, block_hashes=list(range(1, 101)))
    idle = _worker("d1", "decode")
    for _ in range(90):  # 3 requests/s for the last 30 s, as the router saw them routed to d1
        side.arrivals.observe("d1", time.monotonic())
    decision = asyncio.run(side.maybe_disaggregate(Decision(idle, "cold"), _forward(route), [_worker("p1", "prefill")]))
    assert asked == ["p1"] and decision.cached_tokens == 1599
    assert metrics.pd_auto.labels(decision="disaggregated")._value.get() == 1


def test_a_peer_that_decodes_too_would_stall_its_own_requests_instead():
    assert not dataclasses.replace(BUSY, prefill_batch=3).disaggregate
    assert dataclasses.replace(BUSY, prefill_batch=1).disaggregate  # 1 stalled there instead of 3 here


def test_without_prefill_workers_auto_prefills_on_an_idle_peer_never_on_a_decoding_one_nor_the_worker_itself():
    asked: list[str] = []
    side, metrics, _ = _router_side(asked)
    route = RouteRequest(num_prompt_tokens=1600, block_hashes=list(range(1, 101)))
    busy = _worker("a", "both", running=3, inflight=3, decoding=3)
    idle, also_busy = _worker("b", "both"), _worker("c", "both", running=3, inflight=1, decoding=1)

    async def run() -> None:
        await side.maybe_disaggregate(Decision(busy, "cold"), _forward(route), [busy, idle])
        await side.maybe_disaggregate(Decision(busy, "cold"), _forward(route), [busy, also_busy])

    asyncio.run(run())
    assert asked == ["b"]
    # one decoding request on the peer is enough to keep it out: its stream would stall as the decode worker's
    assert metrics.pd_decisions.labels(decision="saturated")._value.get() == 1
    assert metrics.pd_auto.labels(decision="local")._value.get() == 0


def test_an_adapters_prompt_goes_to_a_prefill_worker_serving_it_preferring_one_holding_it_resident():
    side, _, _ = _router_side([])
    route = RouteRequest(num_prompt_tokens=1600, block_hashes=list(range(1, 101)), lora_name="a1")
    base_only = _worker("p0", "prefill")  # reports no adapters: it would refuse a1 (404)
    cold, warm = (_worker(n, "prefill", queued_prefill_tokens=q) for n, q in (("p1", 0), ("p2", 80)))
    cold.adapters = warm.adapters = frozenset({"a1"})
    warm.resident_adapters = frozenset({"a1"})  # 80 tokens queued (80 ms) cost less than loading a1 (0.5 s)
    decode = _worker("d", "decode")
    assert side._prefill_worker([base_only, cold, warm], route, decode)[0] is warm
    assert side._prefill_worker([base_only, cold], route, decode)[0] is cold
    assert side._prefill_worker([base_only], route, decode) is None
