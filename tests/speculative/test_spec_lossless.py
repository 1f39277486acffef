"""Speculation never changes what is sampled: the acceptance rule reproduces the target's distributions.

Two levels: the rule alone on fixed logits (many draws, cheap), and the whole engine on a tiny
random-weight Llama with an 8-token vocabulary, where a drafter that always proposes the same tokens
forces every path (accept, reject-and-resample, bonus) and the emitted tokens are compared with the
target's exact next-token distributions by a chi-squared test. Fixed seeds: the tests are repeatable.
"""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.engine.sampling import Sampler, SamplingParams
from fleetllm.models.config import ModelConfig
from fleetllm.models.llama import AttentionMetadata, LlamaModel, PrefillChunk
from fleetllm.models.loader import LoadedModel
from fleetllm.speculative.drafter import TokenOnlyDrafter, register
from fleetllm.speculative.verify import verify

VOCAB = 8


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-squared p-value of observed ``counts`` against ``probs`` (cells with p = 0 must be empty)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def test_greedy_rule_keeps_drafts_up_to_the_first_argmax_mismatch() -> None:
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 1, 6, 2]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [3, 1, 6], greedy, None) == [3, 1, 6, 2]  # all accepted + bonus
    assert verify(logits, [3, 4, 6], greedy, None) == [3, 1]  # second rejected, argmax instead


def _rule_samples(logits: torch.Tensor, drafts: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [verify(logits, drafts, params, gen) for _ in range(n)]


@pytest.mark.slow
def test_rule_first_token_and_conditional_match_the_target_with_top_k_top_p() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    probs = Sampler._probs(logits, [params] * 3)
    drafts = [int(probs[0].argmax()), int(probs[1].argmin())]  # a likely and an impossible draft
    out = _rule_samples(logits, drafts, params, 6000)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=VOCAB).double()
    assert chi2_pvalue(first, probs[0].double()) > 1e-3
    second = [o[1] for o in out if o[0] == drafts[0]]  # given the first draft was emitted
    counts = torch.bincount(torch.tensor(second), minlength=VOCAB).double()
    assert chi2_pvalue(counts, probs[1].double()) > 1e-3


# ---- the whole engine on a tiny random model -------------------------------------------------------
class _CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i) for i in ids)


def tiny_loaded() -> LoadedModel:
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(7)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return LoadedModel("tiny", cfg, model, _CharTokenizer(), 0.0)  # type: ignore[arg-type]


@register("fixed-test")
class FixedDrafter(TokenOnlyDrafter):
    """Always proposes tokens 1, 2, 3, ...: sometimes right, often wrong, never adaptive."""

    def __init__(self, **_: object) -> None:
        pass

    def propose(self, seqs, ks):  # type: ignore[no-untyped-def]
        return [list(range(1, k + 1)) for k in ks]


@torch.inference_mode()
def target_probs(loaded: LoadedModel, ids: list[int], params: SamplingParams) -> torch.Tensor:
    n = len(ids)
    cfg = loaded.config
    kv = [(torch.zeros(n, cfg.num_kv_heads, cfg.head_dim), torch.zeros(n, cfg.num_kv_heads, cfg.head_dim)) for _ in range(2)]
    slots = torch.arange(n)
    h = loaded.model(torch.tensor(ids), slots, AttentionMetadata(slots, prefills=[PrefillChunk(0, n, slots, True)]), kv)
    return Sampler._probs(loaded.model.compute_logits(h[-1:]), [params])[0].double()


@pytest.mark.slow
def test_engine_with_speculation_samples_the_target_distribution() -> None:
    loaded = tiny_loaded()
    engine = LLMEngine(EngineConfig(model="tiny", num_blocks=512, block_size=4, max_num_seqs=256,
                                    max_num_batched_tokens=2048, max_waiting=4096, speculative="method=fixed-test,k=2,adaptive=0"), loaded)
    prompt = [1, 2, 3, 4]
    params = [SamplingParams(max_tokens=3, temperature=0.9, top_k=6, seed=s, ignore_eos=True) for s in range(3000)]
    for i, p in enumerate(params):
        engine.add_request(str(i), prompt, p)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.pool.check({})
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.spec.num_drafts > 0 and 0 < engine.spec.num_accepted < engine.spec.num_draft_tokens
    seqs = list(outs.values())
    assert all(len(s) == 3 for s in seqs)
    p = params[0]
    # token 1 comes from the prefill step; tokens 2 and 3 from one verify of drafts [1, 2]
    first = max(range(VOCAB), key=lambda t: sum(s[0] == t for s in seqs))
    given = [s for s in seqs if s[0] == first]
    second = torch.bincount(torch.tensor([s[1] for s in given]), minlength=VOCAB).double()
    assert chi2_pvalue(second, target_probs(loaded, prompt + [first], p)) > 1e-3
    pair = max({(s[0], s[1]) for s in given}, key=lambda t: sum((s[0], s[1]) == t for s in seqs))
    third = torch.bincount(torch.tensor([s[2] for s in seqs if (s[0], s[1]) == pair]), minlength=VOCAB).double()
    assert chi2_pvalue(third, target_probs(loaded, prompt + list(pair), p)) > 1e-3
