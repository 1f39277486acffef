"""The mixture-of-experts layer: expert-grouped compute equals each token's own weighted sum of its chosen
experts, and a step never reads the weights of experts no token chose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fleetllm.models.config import ModelConfig
from fleetllm.models.moe import MoE

BASE = dict(architecture="qwen3_moe", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
            num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
KINDS = {
    "softmax-topk-renormalised": dict(norm_topk_prob=True),
    "softmax-topk-shared-expert": dict(shared_expert_intermediate_size=24),
    "topk-softmax-clamped-swiglu": dict(router="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=0.5,
                                        swiglu_alpha=1.702),
}


def moe(kind: str) -> MoE:
    torch.manual_seed(0)
    m = MoE(ModelConfig(**BASE, **KINDS[kind]))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def per_token(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: the router's k experts, each computed from its weights, summed by routing weight."""
    weights, idx = m.route(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for w, e in zip(weights[t], idx[t].tolist(), strict=True):
            acc += w * m._expert(e, x[t : t + 1])[0]
        rows.append(acc)
    out = torch.stack(rows)
    if m.shared is not None:
        out += torch.sigmoid(m.shared_gate(x)) * m.shared(x)
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_grouped_compute_equals_each_tokens_own_sum(kind: str) -> None:
    m = moe(kind)
    x = torch.randn(13, 32)
    torch.testing.assert_close(m(x), per_token(m, x), rtol=1e-5, atol=1e-5)


def test_the_router_weights_follow_the_family() -> None:
    x = torch.randn(5, 32)
    for kind in ("softmax-topk-renormalised", "topk-softmax-clamped-swiglu"):
        weights, _ = moe(kind).route(x)
        torch.testing.assert_close(weights.sum(-1), torch.ones(5))  # renormalised / a softmax over the k
    m = moe("softmax-topk-shared-expert")  # Qwen2-MoE's default: the k chosen keep their share of all E
    weights, idx = m.route(x)
    torch.testing.assert_close(weights, F.softmax(m.router(x), -1).gather(1, idx))


def test_a_step_reads_only_the_chosen_experts() -> None:
    m = moe("softmax-topk-renormalised")
    x = torch.randn(1, 32)  # one decode token
    expected = m(x)
    chosen = set(m.route(x)[1][0].tolist())
    with torch.no_grad():
        for e in set(range(8)) - chosen:  # a read of any of these would spread NaN
            m.gate_up[e].fill_(float("nan"))
            m.down[e].fill_(float("nan"))
    torch.testing.assert_close(m(x), expected)
