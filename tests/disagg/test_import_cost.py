"""Measuring a KV import's cost on a real engine (what `fleetllm calibrate` records for the recommender)."""

from __future__ import annotations

from fleetllm.disagg.import_cost import FrameMaker, import_frame, measure
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.models.loader import LoadedModel


def test_a_measured_import_lands_in_the_prefix_cache_and_counts_the_whole_frame(loaded_model: LoadedModel) -> None:
    eng = LLMEngine(EngineConfig(num_blocks=64), loaded=loaded_model)
    buf = FrameMaker(eng).frame(40)  # two full blocks travel
    timing = import_frame(eng, buf)
    assert timing.nbytes == len(buf) and timing.verify_s > 0 and timing.copy_s > 0 and timing.bytes_per_s > 0
    assert eng.pool.usage == 0.0 and len(eng.pool.cached) == 2  # registered, held by nobody
    eng.pool.check()


def test_measure_gives_rates_and_a_steal_share_and_leaves_the_engine_idle(loaded_model: LoadedModel) -> None:
    eng = LLMEngine(EngineConfig(num_blocks=128, enable_prefix_caching=False), loaded=loaded_model)
    cost = measure(eng, tokens=64, repeats=1, warm=True, steal_tokens=64)
    assert cost.cold_bytes_per_s > 0 and cost.warm_bytes_per_s and cost.steal >= 0.0
    assert not eng.has_unfinished() and eng.pool.usage == 0.0
