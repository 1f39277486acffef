"""A mixture of experts in the step model: active parameters for compute, every weight for memory, and a step's
expert reads growing with the distinct experts its tokens choose."""

from __future__ import annotations

import pytest

from fleetllm.recommend.catalogue import load_catalogue, with_profile
from fleetllm.recommend.model_shape import CATALOGUE, ModelShape, profiled_shape
from fleetllm.recommend.perf_model import Measured
from fleetllm.sim.profile import TimingProfile

CAT = load_catalogue()
SMOL = CATALOGUE["smollm2-135m"]
# the realistic shape of benchmarks/moe_vs_hf.py: hidden 1024, 64 experts of 512, top 8, 16 layers
MOE = ModelShape("moe", 16, 1024, 16, 4, 64, 49152, 4096, experts=64, experts_per_token=8, moe_intermediate=512,
                 tied=True)


def test_one_token_touches_its_k_experts_and_many_touch_them_all() -> None:
    assert MOE.experts_touched(1) == pytest.approx(8)
    assert MOE.experts_touched(8) == pytest.approx(64 * (1 - (1 - 8 / 64) ** 8))  # ~42
    assert MOE.experts_touched(1000) == pytest.approx(64)
    assert SMOL.experts_touched(8) == 0


def test_a_step_reads_the_active_weights_for_one_token_and_every_weight_for_many() -> None:
    expert = 3 * 1024 * 512
    assert MOE.params_read(1) == MOE.params - 16 * 56 * expert
    assert MOE.params_read(1) < MOE.params_read(8) < MOE.params_read(64) < MOE.params
    assert MOE.params_read(1000) == pytest.approx(MOE.params)
    assert SMOL.params_read(1) == SMOL.params_read(64) == SMOL.params


def test_memory_counts_every_expert_and_compute_the_chosen_ones() -> None:
    m = Measured(TimingProfile.default(), MOE, CAT.formats["fp32"], SMOL)
    assert m.weight_bytes == 4 * MOE.params
    assert m.scale == pytest.approx(MOE.active_params / SMOL.active_params)


def test_a_model_whose_experts_do_not_fit_this_machine_gets_no_kv_cache() -> None:
    """30B-A3B: 3.3 B active parameters would be fast enough here, but its 30.5 B do not fit 12 GB in fp32."""
    cpu, fp32 = CAT.instance("local-cpu"), CAT.formats["fp32"]
    big = Measured(TimingProfile.default(), CATALOGUE["qwen3-30b-a3b"], fp32, SMOL, memory_gb=cpu.memory_gb)
    assert big.kv_capacity_tokens() == 0
    assert Measured(TimingProfile.default(), MOE, fp32, SMOL, memory_gb=cpu.memory_gb).kv_capacity_tokens() > 0


def test_a_scaled_moe_step_adds_the_reads_of_the_experts_beyond_one_tokens() -> None:
    profile = TimingProfile.default()
    m = Measured(profile, MOE, CAT.formats["fp32"], SMOL)
    assert m.step_seconds(1, 0, 64) == pytest.approx(profile.step_seconds(1, 0, 64) * m.scale)
    extra = profile.overlap_s * (MOE.params_read(8) - MOE.params_read(1)) / SMOL.params
    assert m.step_seconds(8, 0, 512) == pytest.approx(profile.step_seconds(8, 0, 512) * m.scale + extra)


def test_a_dense_model_or_a_profile_of_the_model_itself_adds_nothing() -> None:
    profile = TimingProfile.default()
    l8 = Measured(profile, CATALOGUE["llama-3.1-8b"], CAT.formats["fp32"], SMOL)
    assert l8.step_seconds(8, 0, 512) == pytest.approx(profile.step_seconds(8, 0, 512) * l8.scale)
    itself = Measured(profile, MOE, CAT.formats["fp32"], MOE)
    assert itself.measured and itself.step_seconds(8, 0, 512) == profile.step_seconds(8, 0, 512)


def test_a_calibrated_profile_times_only_this_machines_instances(tmp_path) -> None:
    path = tmp_path / "p.json"
    TimingProfile.default().save(path)
    cat = with_profile(CAT, str(path))
    assert cat.instance("local-cpu").profile == str(path)
    assert cat.instance("p5.48xlarge").profile == CAT.instance("p5.48xlarge").profile is None
    assert with_profile(CAT, None) is CAT


def test_the_profiled_model_is_read_from_its_reference_or_left_unknown(tmp_path) -> None:
    assert profiled_shape("smollm2-135m") == SMOL
    assert profiled_shape(str(tmp_path / "missing.gguf")) is None
