"""``fleetllm spec train``: the data split, the batch layout, and that training computes exactly what the
drafters compute at inference (same slots, same positions, same features)."""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.sequence import Sequence
from fleetllm.models.loader import LoadedModel
from fleetllm.speculative.drafter import create_drafter
from fleetllm.speculative.eagle import DraftHead, HeadConfig
from fleetllm.speculative.train import (
    Batcher,
    Corpus,
    chat_prompts,
    depth_logits,
    init_from_target,
    target_features,
    tool_prompts,
)


@pytest.fixture(scope="module")
def loaded(loaded_model: LoadedModel) -> LoadedModel:
    return loaded_model  # the session's weights (tests/conftest.py)


def test_generated_prompts_are_deterministic_and_varied() -> None:
    assert chat_prompts(20, seed=3) == chat_prompts(20, seed=3)
    assert len(set(chat_prompts(50, seed=0))) > 40
    tools = tool_prompts(30, seed=0)
    assert all(p.startswith("The tool `") for p in tools)
    assert {p.count("{") > 0 for p in tools} == {True, False}  # JSON records and logs / tables


def toy_corpus(n_seqs: int, length: int, kinds: list[str]) -> Corpus:
    n = n_seqs * length
    return Corpus(torch.arange(n) % 97, torch.randn(n, 6), torch.randn(n, 2), [i * length for i in range(n_seqs)],
                  [length] * n_seqs, kinds, [0 if k == "text" else 12 for k in kinds])


def test_held_out_sequences_are_whole_and_never_trained_on() -> None:
    c = toy_corpus(40, 30, ["chat", "text"] * 20)
    b = Batcher(c, window=4, depth=3, seed=0)
    train, held = b.anchors(held_out=False), b.anchors(held_out=True)
    seq_of = lambda a: torch.searchsorted(torch.tensor(c.starts), a, right=True) - 1  # noqa: E731
    held_seqs = set(seq_of(held).tolist())
    assert held_seqs == {i for i in range(40) if i % Batcher.HOLD_OUT_EVERY == 0}
    assert not held_seqs & set(seq_of(train).tolist())
    assert set(seq_of(b.anchors(held_out=True, kind="text")).tolist()) <= {i for i in held_seqs if c.kinds[i] == "text"}
    # answers train from where drafting starts (after the first sampled token), text from its start
    offsets = {c.kinds[i]: set() for i in range(40)}
    for a in train.tolist():
        offsets[c.kinds[a // 30]].add(a % 30)
    assert min(offsets["chat"]) == 12 - 1 and min(offsets["text"]) == 4 - 1
    # every window stays inside its sequence: context, the token after it, and the K label positions
    batch = b.batch(train)
    assert (batch["ctx_pos"] >= 1).all() and (batch["ctx_pos"][:, -1] + 3 < 30).all()
    assert torch.equal(batch["ahead_tok"][:, 0], batch["ctx_tok"][:, -1])  # slot d=0 holds the last sampled token


@pytest.mark.parametrize("method", ["eagle", "peagle"])
def test_training_forward_equals_the_drafter_at_inference(loaded: LoadedModel, method: str, tmp_path) -> None:
    torch.manual_seed(0)
    cfg = HeadConfig.for_target(loaded.model, method, "smollm2-135m")
    head = DraftHead(cfg)
    init_from_target(head, loaded, torch.arange(cfg.draft_vocab_size))
    with torch.no_grad():  # a head that is not the identity-like init, so a misaligned slot shows
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / f"{method}.safetensors"
    head.save(path)
    head = DraftHead.load(path)  # what the drafter loads (bf16 round trip)
    drafter = create_drafter(method, loaded=loaded, head=str(path))
    k = 4
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "List three prime numbers and one even one."}]))
    e = len(ids) - 1  # features exist for positions < e; ids[e] is the last sampled token
    aux, _ = target_features(loaded, ids, cfg.aux_layers)
    seq = Sequence("r", ids, SamplingParams(), max_tokens=16)
    seq.num_computed_tokens = e
    drafter.observe(seq, 0, aux[:e])
    drafts = drafter.propose([seq], [k])[0]
    assert len(drafts) == k

    # the same anchor in the training layout; teacher-forced tokens = the drafts (what an accepted chain holds)
    full = ids + drafts
    aux_full, final_full = target_features(loaded, full, cfg.aux_layers)
    corpus = Corpus(torch.tensor(full), aux_full, final_full, [0], [len(full)], ["chat"], [len(ids)])
    batch = Batcher(corpus, cfg.window, k, seed=0).batch(torch.tensor([e - 1]))
    lm_weight = loaded.model.lm_head.weight[head.draft_to_target]
    with torch.no_grad():
        trained = head.draft_to_target[depth_logits(head, loaded, batch, lm_weight).argmax(-1)][0].tolist()
    assert trained == drafts
