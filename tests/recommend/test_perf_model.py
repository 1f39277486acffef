"""The step model: roofline on accelerators, the measured profile on this machine."""

from __future__ import annotations

import pytest

from fleetllm.recommend.catalogue import load_catalogue
from fleetllm.recommend.model_shape import CATALOGUE
from fleetllm.recommend.perf_model import Measured, Roofline
from fleetllm.sim.profile import TimingProfile

CAT = load_catalogue()
L8 = CATALOGUE["llama-3.1-8b"]


def roofline(inst: str = "p5.48xlarge", fmt: str = "bf16", tp: int = 1, shape=L8) -> Roofline:  # type: ignore[no-untyped-def]
    return Roofline(shape, CAT.instance(inst), CAT.formats[fmt], tp)


@pytest.mark.parametrize("args", [lambda n: (n, 0, 1024 * n), lambda n: (1, 0, 512 * n), lambda n: (0, 64 * n, 0)])
def test_step_time_never_falls_as_batch_context_or_prompt_grows(args) -> None:  # type: ignore[no-untyped-def]
    r = roofline()
    times = [r.step_seconds(*args(n)) for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert times == sorted(times)


def test_decode_is_bandwidth_bound_and_prefill_compute_bound() -> None:
    r = roofline()
    weights_read = r.weight_bytes / (CAT.instance("p5.48xlarge").bandwidth_gbs * 1e9)
    assert r.step_seconds(1, 0, 0) >= weights_read  # one token still reads every weight
    assert r.step_seconds(0, 8192, 0) > 10 * r.step_seconds(1, 0, 0)


def test_faster_memory_and_fewer_bytes_make_decode_faster() -> None:
    assert roofline("p5e.48xlarge").step_seconds(8, 0, 8000) < roofline("p5.48xlarge").step_seconds(8, 0, 8000)
    assert roofline(fmt="fp8").step_seconds(1, 0, 0) < roofline(fmt="bf16").step_seconds(1, 0, 0)


def test_weights_that_do_not_fit_leave_no_kv_cache() -> None:
    assert roofline("g6.xlarge", shape=CATALOGUE["llama-3.1-70b"]).kv_capacity_tokens() == 0
    assert roofline("p5.48xlarge", tp=2, shape=CATALOGUE["llama-3.1-70b"]).kv_capacity_tokens() < 50_000  # bf16: just fits
    assert roofline("p5.48xlarge", "fp8", tp=2, shape=CATALOGUE["llama-3.1-70b"]).kv_capacity_tokens() > 200_000  # bf16 KV


def test_tensor_parallel_splits_the_weights_but_pays_all_reduces() -> None:
    one, two = roofline(tp=1), roofline(tp=2)
    assert two.step_seconds(1, 0, 0) < one.step_seconds(1, 0, 0)
    assert two._allreduce_seconds(1) > 0 == one._allreduce_seconds(1)


def test_the_measured_profile_is_used_as_is_for_its_own_model() -> None:
    profile = TimingProfile.default()
    m = Measured(profile, CATALOGUE["smollm2-135m"], CAT.formats["fp32"], CATALOGUE["smollm2-135m"])
    assert m.measured and m.step_seconds(8, 0, 512) == profile.step_seconds(8, 0, 512)
    scaled = Measured(profile, L8, CAT.formats["fp32"], CATALOGUE["smollm2-135m"])
    assert not scaled.measured and scaled.step_seconds(8, 0, 512) > 10 * m.step_seconds(8, 0, 512)


def test_a_validation_calibration_scales_the_measured_steps_and_adds_the_serving_overhead() -> None:
    from fleetllm.recommend.calibration import Calibration, fit

    rows = [{"predicted": {"itl_p50_ms": 100.0, "ttft_p50_ms": 400.0}, "measured": {"itl_p50_ms": 120.0, "ttft_p50_ms": 580.0}}]
    cal = Calibration(**{k: v for k, v in fit(rows).items() if k != "source"})
    assert cal.step_scale == pytest.approx(1.2) and cal.request_overhead_s == pytest.approx(0.1)
    smol = CATALOGUE["smollm2-135m"]
    plain = Measured(TimingProfile.default(), smol, CAT.formats["fp32"], smol)
    tuned = Measured(TimingProfile.default(), smol, CAT.formats["fp32"], smol, cal)
    assert tuned.step_seconds(4, 0, 256) == pytest.approx(1.2 * plain.step_seconds(4, 0, 256))
    assert tuned.request_overhead_s == pytest.approx(0.1) and plain.request_overhead_s == 0.0
    again = fit(rows, cal)  # predictions already calibrated: the correction compounds, it does not restart
    assert again["step_scale"] == pytest.approx(1.44)


def test_an_fp8_kv_cache_holds_twice_the_tokens_and_halves_the_kv_read() -> None:
    from fleetllm.recommend.perf_model import Efficiency

    bf16, fp8 = roofline(fmt="fp8"), Roofline(L8, CAT.instance("p5.48xlarge"), CAT.formats["fp8"], 1, Efficiency(kv_cache_bytes=1.0))
    assert fp8.kv_capacity_tokens() == pytest.approx(2 * bf16.kv_capacity_tokens(), rel=1e-6)
    assert fp8.step_seconds(256, 0, 256 * 2000) < bf16.step_seconds(256, 0, 256 * 2000)


def test_attention_adds_to_the_weight_multiplies_rather_than_hiding_behind_them() -> None:
    r = roofline(fmt="fp8")
    linear_only, with_context = r.step_seconds(512, 0, 0), r.step_seconds(512, 0, 512 * 1000)
    kv_read = 512 * 1000 * r.kv_bytes_per_token / (CAT.instance("p5.48xlarge").bandwidth_gbs * 1e9 * r.eff.bandwidth)
    assert with_context == pytest.approx(linear_only + kv_read, rel=0.02)  # compute-bound GEMMs + a KV-bound attention
