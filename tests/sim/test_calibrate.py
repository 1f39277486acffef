"""``fleetllm calibrate``: sweeps over every point, each point's median over the sweeps, the curve as measured."""

from __future__ import annotations

import pytest

from fleetllm.sim.calibrate import (
    DECODE_POINTS,
    PREFILL_POINTS,
    median_per_point,
    profile_from,
    spread,
    sweep,
)
from fleetllm.sim.profile import TimingProfile


class _FakeBench:
    """Step times from a table; ``burst`` multiplies every point of one sweep (another job on the cores)."""

    def __init__(self, burst_in_sweep: int, factor: float = 3.0) -> None:
        self.sweep, self.burst, self.factor = 0, burst_in_sweep, factor
        self.calls: list[tuple[str, int]] = []

    def _t(self, base: float) -> float:
        return base * (self.factor if self.sweep == self.burst else 1.0)

    def prefill_time(self, p: int) -> float:
        self.calls.append(("prefill", p))
        return self._t(0.1 + 0.003 * p)

    def decode_time(self, b: int, ctx: int) -> float:
        self.calls.append(("decode", b))
        small = {2: 0.104, 3: 0.128}  # slower than batch 4, as the engine is on one thread
        return self._t(small.get(b, 0.06 + 0.0075 * b) + 1e-5 * b * ctx)


def _sweeps(n: int, burst: int) -> list[dict]:
    bench = _FakeBench(burst)
    out = []
    for i in range(n):
        bench.sweep = i
        out.append(sweep(bench, 64, 1024))  # type: ignore[arg-type]
    return out


def test_a_sweep_measures_every_prefill_and_decode_point_and_both_contexts() -> None:
    (s,) = _sweeps(1, burst=-1)
    assert {p for kind, p in s if kind == "prefill"} == set(PREFILL_POINTS)
    assert {b for kind, b in s if kind == "decode"} == set(DECODE_POINTS)
    assert {("context", 64), ("context", 1024)} <= set(s)


def test_every_batch_up_to_six_is_measured_where_the_small_batch_curve_bends() -> None:
    assert set(range(1, 7)) <= set(DECODE_POINTS)


def test_a_burst_during_one_sweep_does_not_reach_the_profile() -> None:
    clean = median_per_point(_sweeps(1, burst=-1))
    noisy = _sweeps(5, burst=2)
    assert median_per_point(noisy) == clean
    assert spread(noisy)["decode", 4] == pytest.approx(2.0)  # (3x - 1x) / 1x: the burst is reported


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    assert median_per_point([{("decode", 1): 1.0}, {("decode", 1): 3.0}]) == {("decode", 1): 2.0}


def test_the_profile_keeps_the_decode_curve_as_measured_not_monotone() -> None:
    prof = profile_from(median_per_point(_sweeps(3, burst=0)), 64, 1024, model="m", device="cpu", threads=1,
                        block_size=16, num_blocks=100, sweeps=3)
    decode = dict(prof.decode)
    assert decode[3] > decode[4]  # measured so: a step of 3 sequences takes longer than one of 4
    assert prof.step_seconds(3, 0, 3 * 64) == pytest.approx(decode[3])
    assert prof.ctx_s_per_token == pytest.approx(1e-5)
    assert prof.sweeps == 3 and [n for n, _ in prof.prefill] == sorted(PREFILL_POINTS)


def test_a_mixed_step_pays_the_fixed_batch_one_cost_once() -> None:
    prof = TimingProfile("m", "cpu", 1, 16, 100, prefill=[(16, 0.2), (128, 0.5)], decode=[(1, 0.06), (2, 0.1), (4, 0.09)])
    assert prof.overlap_s == pytest.approx(0.06)
    assert prof.step_seconds(2, 128) == pytest.approx(0.1 + 0.5 - 0.06)
