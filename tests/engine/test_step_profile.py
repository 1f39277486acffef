"""--profile-steps: the per-phase breakdown of engine steps, and the sampler's partial-sort paths
against a full sort of the vocabulary."""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine import sampling
from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.params import SamplingParams
from fleetllm.engine.sampling import Sampler
from fleetllm.engine.step_profile import PHASES, StepProfile
from fleetllm.models.loader import LoadedModel


def test_a_profiling_engine_times_every_phase_of_its_decode_steps(loaded_model: LoadedModel) -> None:
    # op by op (exact fp32): under q4 the decode stack runs attention inside one C call, where no hook sees it
    engine = LLMEngine(EngineConfig(num_blocks=32, profile_steps=True, quantization="none"), loaded=loaded_model)
    try:
        engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.add_request("b", [6, 7, 8], SamplingParams(max_tokens=4, temperature=0.9, top_p=0.9, seed=3))
        while engine.has_unfinished():
            engine.step()
        prof = engine.profile
        assert prof.steps >= 4 and prof.tokens == 8
        ms = prof.per_step_ms()
        assert set(PHASES) <= set(ms)
        assert ms["forward"] > ms["attention"] > 0 and ms["sampling"] > 0 and ms["update"] > 0
        assert ms["step"] >= ms["forward"] + ms["logits"] + ms["sampling"]
        prof.reset()
        assert prof.steps == 0 and prof.per_step_ms()["forward"] == 0
    finally:
        for h in engine.executor.attention_hooks:  # the shared model must not keep the timers
            h.remove()


def test_without_profiling_the_engine_keeps_no_profile(loaded_model: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=16), loaded=loaded_model)
    assert engine.profile is None and engine.executor.attention_hooks == []


def test_the_summary_names_each_phase() -> None:
    p = StepProfile()
    p.add("forward", 0.010)
    p.step_done(0.012, 1)
    assert p.per_step_ms()["outside_forward"] == pytest.approx(2.0)
    assert "forward 10.00" in p.summary()


def full_sort_support(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens the reference (whole-vocabulary sort, as speculative verification uses) gives probability."""
    probs = Sampler._probs(logits.unsqueeze(0), [params])[0]
    return set(probs.nonzero().flatten().tolist())


@pytest.mark.parametrize("kw", [{"top_k": 5}, {"top_p": 0.5}, {"top_p": 0.97}, {"top_k": 40, "top_p": 0.8},
                                {"top_k": 20, "min_p": 0.1}, {"top_p": 0.9, "min_p": 0.05}])
def test_partial_sorts_keep_exactly_the_tokens_a_full_sort_keeps(kw: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", (4, 16))  # small tries, so wide nuclei take the fallback
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * torch.tensor([0.3, 1.0, 2.0, 4.0, 8.0, 0.1]).unsqueeze(1)
    params = SamplingParams(temperature=0.7, **kw)
    kept = {0: sampling._top_k_candidates, 1: sampling._top_p_candidates}[int(params.top_k <= 0)]
    probs, order = kept(logits / params.temperature, [params] * 6)
    for row in range(6):
        got = set(order[row][probs[row] > 0].tolist())
        assert got == full_sort_support(logits[row], params)


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -5.0])
    params = SamplingParams(temperature=1.0, top_k=3)
    n = 4000
    res = Sampler()(logits.expand(n, -1).clone(), [params] * n, [None] * n, [[]] * n, [[]] * n)
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=5).float() / n
    expected = Sampler._probs(logits.unsqueeze(0), [params])[0]
    assert counts[3:].sum() == 0
    assert torch.allclose(counts, expected, atol=0.03)
