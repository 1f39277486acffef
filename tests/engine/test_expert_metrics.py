"""A mixture-of-experts worker reports how evenly each layer's router spread each step's tokens."""

from __future__ import annotations

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.engine.expert_metrics import imbalance


def test_imbalance_is_the_busiest_expert_over_the_mean() -> None:
    assert imbalance([3, 3, 3, 3]) == 1.0
    assert imbalance([8, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) is None


def _samples(llm: LLM, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for m in llm.engine.metrics.registry.collect()
            for s in m.samples if s.name == name}


@pytest.mark.parametrize("per_expert", [False, True])
def test_each_moe_layer_observes_each_step(per_expert: bool, family_models) -> None:
    path, _ = family_models.get("qwen3_moe")
    llm = LLM(str(path), quantization="none", moe_expert_metrics=per_expert)
    llm.generate([[5, 17, 99, 3], [200, 201]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    counts = _samples(llm, "fleetllm_moe_expert_imbalance_count")
    assert {dict(k)["layer"] for k in counts} == {"0", "1"}
    assert all(v == 4 for v in counts.values())  # 1 prefill + 3 decode steps; the warm-up is not counted
    tokens = _samples(llm, "fleetllm_moe_expert_tokens_total")
    if not per_expert:
        assert tokens == {}
    else:  # 6 prompt tokens + 2 x 3 decoded (the last sampled token is never fed back), 2 experts each, per layer
        for layer in ("0", "1"):
            assert sum(v for k, v in tokens.items() if dict(k)["layer"] == layer) == (6 + 6) * 2
