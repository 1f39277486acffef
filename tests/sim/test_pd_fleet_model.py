"""The P/D fleet model behind ``benchmarks/disaggregation.py --fleet sim``."""

from __future__ import annotations

from pathlib import Path

from fleetllm.sim.pd_fleet import PdTraffic, rate_for_load, simulate_pd
from fleetllm.sim.profile import TimingProfile

# an fp32 profile kept as test data: these tests pin the P/D model's decisions, not what the shipped profile (which
# follows the default engine) happens to measure; under q4's cheap decode steps few requests decode at any instant,
# so in these 60-s runs `auto` moves no prefill (300 s: 28%; git log -p BENCHMARKS.md, "P/D at scale on paper with
# the q4 profile")
PROFILE = TimingProfile.load(Path(__file__).parents[1] / "data" / "timing_profile_1a4c4e1.json")
KV = 46080  # SmolLM2-135M fp32 bytes per token


def _traffic(share: float, load: float = 0.5) -> PdTraffic:
    return PdTraffic(rate_for_load(PROFILE, PdTraffic(0.0, share), load), share)


def test_a_prefill_pool_spares_the_short_requests_the_long_prefills_stalls():
    t = _traffic(0.25)
    colocated = simulate_pd(PROFILE, t, 8, 0, 1024, KV, 1e9, seconds=120)
    split = simulate_pd(PROFILE, t, 8, 2, 1024, KV, 1e9, seconds=120)
    assert colocated.remote_share == 0 and split.remote_share > 0.3  # longs of 1,024+ tokens went remote
    assert split.short_itl_p99_ms < 0.6 * colocated.short_itl_p99_ms


def test_auto_keeps_prefills_local_when_moving_the_kv_costs_more_than_computing_it():
    t = _traffic(0.25)
    slow_link = simulate_pd(PROFILE, t, 8, 2, "auto", KV, 1e5, seconds=60)  # 100 kB/s: minutes per document
    fast_link = simulate_pd(PROFILE, t, 8, 2, "auto", KV, 1e9, seconds=60)
    assert slow_link.remote_share == 0 and fast_link.remote_share > 0


def test_more_load_than_the_fleet_serves_is_reported_as_saturated():
    assert simulate_pd(PROFILE, _traffic(0.25, load=3.0), 8, 0, 1024, KV, 1e9, seconds=60).saturated
    assert not simulate_pd(PROFILE, _traffic(0.05, load=0.3), 8, 0, 1024, KV, 1e9, seconds=60).saturated
