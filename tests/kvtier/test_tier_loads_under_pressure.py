"""A tier-held prefix longer than the free blocks at admission is still loaded whole: the part that found no
blocks then is asked for again on the request's next steps, once blocks are free, rather than recomputed."""

from __future__ import annotations

from pathlib import Path

from fleetllm.engine.engine import EngineConfig, LLMEngine, RequestOutput
from fleetllm.engine.params import SamplingParams
from fleetllm.kvtier.attach import attach_tiers
from fleetllm.models.loader import LoadedModel
from tests.kvtier.tier_helpers import close, engine_with, flush, metric, prompt, run

LONG = prompt(17, n=300)  # 18 full blocks held by the tier: 19 blocks with its last tokens
HOG = prompt(19, n=200)  # holds 13 of the 30 blocks while LONG is admitted, and finishes right after


def test_a_tier_prefix_that_finds_too_few_free_blocks_at_admission_is_loaded_on_the_next_steps(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    writer, w_tiers = engine_with(loaded_model, disk_dir=tmp_path, disk_gb=0.05)
    reference, _ = run(writer, LONG)
    flush(w_tiers)
    close(w_tiers)

    engine = LLMEngine(EngineConfig(num_blocks=30, max_num_batched_tokens=256), loaded=loaded_model)
    tiers = attach_tiers(engine, disk_dir=tmp_path, disk_gb=0.05)
    engine.add_request("hog", HOG, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()  # the hog's prompt computed: 13 blocks held, 17 free, LONG needs 19
    engine.add_request("long", LONG, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == "long"]
    close(tiers)
    assert outs[-1].finished and not outs[-1].error
    assert metric(engine, 'fleetllm:kv_tier_hits_total{tier="disk"}') == 18  # every tier-held block loaded
    assert outs[-1].num_cached_tokens == 287  # all 288 but the one token the admission step computes
    assert [t for o in outs for t in o.new_token_ids] == reference
    engine.pool.check()
