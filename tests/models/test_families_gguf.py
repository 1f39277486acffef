"""Models converted to GGUF by llama.cpp's own converter load to HF transformers' outputs: F32 mixtures of experts
(Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, GPT-OSS with its sinks, biases and alternating windows) and
dense families (Mistral, Phi-3's fused projections and longrope factors, Gemma 2's soft-capping and alternating
windows, from a SentencePiece vocabulary) equal to the HF model, Q8_0 (Qwen3-MoE) equal to the HF model
whose weights are rounded as Q8_0 rounds them, in exact mode and with the experts, attention and LM head on the
Q8_0 kernel; Q8_0 experts, attention projections and token embedding stay quantised in memory; 4-bit experts
(Q4_1 gate and up, Q4_0 down) stay 4-bit, equal to the HF model on their dequantised weights in exact mode and
on the experts kernel."""

from __future__ import annotations

import pytest
import torch
from families import converter, hf_greedy_logprobs, q8_0, requantise

from fleetllm import LLM, SamplingParams
from fleetllm.kernels import moe_experts
from fleetllm.kernels.moe_experts import Q4Weight
from fleetllm.models.gguf_file import read_gguf_file
from fleetllm.models.loader import load_model
from fleetllm.models.q8_weights import PackedQ8Embedding, PackedQ8Linear

PROMPTS = [[5, 17, 99, 3, 42, 42, 7], list(range(10, 130, 3)), [200, 201]]
NEW = 32

pytestmark = pytest.mark.skipif(converter() is None, reason="llama.cpp's converter is not unpacked (scripts/setup.sh)")


def greedy(path, quantization: str = "none") -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(path), quantization=quantization, max_num_batched_tokens=16, num_blocks=64)
    res = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    return [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in res]


# The fast path's bound on logprobs: its narrow steps round activations to int16 per group of 32 (the q4 default's
# contract; tests/models/test_fast_path_quality.py holds its perplexity within 1e-3 of fp32's), where exact mode's
# outputs stay within float rounding (1e-4) of transformers'
FAST_PATH_LOGPROB_TOL = 1e-3


def assert_equal_to(hf, outs: list[tuple[list[int], list[float]]], tol: float = 1e-4) -> None:
    for prompt, (out, logprobs) in zip(PROMPTS, outs, strict=True):
        ref = hf_greedy_logprobs(hf, prompt, out)
        assert ref.argmax(-1).tolist() == out
        assert (ref[range(NEW), out] - torch.tensor(logprobs)).abs().max() < tol


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def test_an_f32_moe_gguf_equals_transformers(family: str, family_models) -> None:
    path, hf = family_models.gguf(family, "f32")
    assert_equal_to(hf, greedy(path))


def test_an_mxfp4_gpt_oss_gguf_equals_transformers_on_its_dequantised_experts(family_models) -> None:
    """OpenAI's MXFP4 expert layout, kept MXFP4 by llama.cpp's converter, held as Q8_0 levels of exactly its weights
    (no fp32 copy): transformers' greedy tokens on the dequantised experts."""
    path, hf = family_models.gguf_mxfp4()
    assert {t.tensor_type.name for t in read_gguf_file(path).tensors if "_exps.weight" in t.name} == {"MXFP4"}
    moes = [layer.mlp for layer in load_model(str(path)).model.layers]
    assert all(m.gate_up is None and m.down is None for m in moes)
    assert_equal_to(hf, greedy(path))


@pytest.mark.parametrize("family", ["mistral", "phi3", "gemma2"])
def test_an_f32_dense_family_gguf_equals_transformers(family: str, family_models) -> None:
    path, hf = family_models.gguf(family, "f32")
    assert load_model(str(path)).config.architecture == {"mistral": "llama"}.get(family, family)
    assert_equal_to(hf, greedy(path))


@pytest.fixture(scope="module")
def q8_reference(family_models):
    return rounded_reference(family_models, "qwen3_moe")


def rounded_reference(family_models, family: str):
    """The family's Q8_0 GGUF, and its HF model with every weight llama.cpp stores as Q8_0 rounded so (norms and
    the router stay F32)."""
    path, hf = family_models.gguf(family, "q8_0")
    rounded = type(hf)(hf.config).eval()
    with torch.no_grad():
        for (name, p), (_, q) in zip(rounded.named_parameters(), hf.named_parameters(), strict=True):
            p.copy_(q8_0(q) if q.dim() >= 2 and not name.endswith(("mlp.gate.weight", "moe.gate.weight")) else q)
    return path, rounded


def test_a_q8_0_qwen3_moe_gguf_equals_transformers_on_its_rounded_weights(q8_reference) -> None:
    path, hf = q8_reference
    assert_equal_to(hf, greedy(path))


def test_a_q8_0_mixtral_gguf_equals_transformers_on_its_rounded_weights(family_models) -> None:
    """Llama's layout: llama.cpp permutes the Q/K rows, and the loader unpermutes the kept Q8_0 levels and scales."""
    path, hf = rounded_reference(family_models, "mixtral")
    assert_equal_to(hf, greedy(path))


def test_q8_0_experts_run_quantised_by_default_to_the_same_outputs(q8_reference) -> None:
    """Under the default quantization the experts, attention projections and LM head keep their Q8_0 levels (the
    Q8_0 kernels, activations rounded to int16, for narrow steps): greedy tokens equal, logprobs within the fast
    path's bound."""
    path, hf = q8_reference
    # an fp32 pool (whatever auto is under it): what is held to transformers' logprobs is the Q8_0 weights
    llm = LLM(str(path), max_num_batched_tokens=16, num_blocks=64, kv_cache_dtype="fp32")
    served = llm.engine.executor.runner.model
    assert all(layer.mlp.q8 is not None for layer in served.layers)
    assert all(m.q8_rows > 1 for layer in served.layers for m in (layer.attn.qkv, layer.attn.o))
    assert served.lm_head.q8_rows > 1
    res = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    assert_equal_to(hf, [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in res],
                    FAST_PATH_LOGPROB_TOL)


def test_q8_0_experts_stay_quantised_in_memory(q8_reference) -> None:
    """A Q8_0 GGUF's experts load as int8 levels and fp32 scales (no fp32 copy): at most 1.3x their bytes in the file."""
    path, _ = q8_reference
    model = load_model(str(path)).model
    in_file = sum(t.data.nbytes for t in read_gguf_file(path).tensors if t.name.endswith("_exps.weight"))
    moes = [layer.mlp for layer in model.layers]
    assert all(m.gate_up is None and m.down is None for m in moes)
    held = sum(b.nbytes for m in moes for b in (m.gate_up_q8, m.gate_up_d, m.down_q8, m.down_d))
    assert in_file <= held <= 1.3 * in_file


def test_q8_0_attention_and_embeddings_stay_quantised_in_memory(q8_reference) -> None:
    """A Q8_0 GGUF's attention projections and token embedding load as int8 levels and fp32 scales, the tied LM head
    sharing the embedding's: no fp32 weight matrix is left but the router's (F32 in the file)."""
    path, _ = q8_reference
    model = load_model(str(path)).model
    assert isinstance(model.embed, PackedQ8Embedding) and model.lm_head.q8 is model.embed.q8
    for layer in model.layers:
        assert isinstance(layer.attn.qkv, PackedQ8Linear) and isinstance(layer.attn.o, PackedQ8Linear)
        assert layer.attn.qkv.q8.dtype == torch.int8 and layer.attn.qkv.q8_rows == 0  # exact mode never on the GEMV
    fp32 = {n for n, t in (*model.named_parameters(), *model.named_buffers())
            if t.dtype == torch.float32 and t.dim() >= 2 and not n.startswith("rotary.") and not n.endswith("_d")}
    # (``*_d``: the Q8_0 scales, one per 32 weights)
    assert fp32 == {f"layers.{i}.mlp.router.weight" for i in range(len(model.layers))}


@pytest.fixture(scope="module")
def q4_reference(family_models, tmp_path_factory):
    """The F32 Qwen3-MoE GGUF with its experts 4-bit (gate and up Q4_1, down Q4_0), and its HF model with those
    experts' dequantised weights."""
    from gguf import GGMLQuantizationType as T

    src, hf = family_models.gguf("qwen3_moe", "f32")
    path = tmp_path_factory.mktemp("q4-experts") / "qwen3-moe-q4.gguf"
    rounded = requantise(src, path, {"ffn_gate_exps": T.Q4_1, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q4_0})
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            gate, up, down = (rounded[f"blk.{i}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            layer.mlp.experts.down_proj.copy_(down)
    return path, ref


def test_4_bit_experts_stay_4_bit_in_memory(q4_reference) -> None:
    """No fp32 copy: 4-bit levels, uint8 factors and fp32 scales, at most 1.5x their bytes in the file (Q4_0's and
    Q4_1's blocks of 32 hold a scale pair each; Q4_K's super-blocks of 256 one in 8 groups: see expert_quant.py)."""
    path, _ = q4_reference
    model = load_model(str(path)).model
    in_file = sum(t.data.nbytes for t in read_gguf_file(path).tensors if t.name.endswith("_exps.weight"))
    moes = [layer.mlp for layer in model.layers]
    assert all(m.gate_up is None and m.down is None and isinstance(m.q8[0][1], Q4Weight) for m in moes)
    held = sum(b.nbytes for m in moes for w in ("gate_up", "down") for b in (m.get_buffer(f"{w}_{p}") for p in ("q4", "f", "d")))
    assert in_file <= held <= 1.5 * in_file


def test_a_4_bit_experts_gguf_equals_transformers_on_its_dequantised_experts(q4_reference) -> None:
    path, hf = q4_reference
    assert_equal_to(hf, greedy(path))


def test_4_bit_experts_run_on_the_experts_kernel_by_default_to_the_same_outputs(q4_reference) -> None:
    path, hf = q4_reference
    moe_experts.kernel_ready(wait=True)  # built before the first step, so that every narrow step takes it
    llm = LLM(str(path), max_num_batched_tokens=16, num_blocks=64, kv_cache_dtype="fp32")
    served = llm.engine.executor.runner.model
    assert all(layer.mlp.q8_rows > 1 and isinstance(layer.mlp.q8[0][0], Q4Weight) for layer in served.layers)
    res = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    assert all(layer.mlp._fused not in (None, False) for layer in served.layers)  # the experts kernel served
    assert_equal_to(hf, [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in res],
                    FAST_PATH_LOGPROB_TOL)


def test_a_mixture_of_experts_4_bit_attention_loads_as_q8_0_within_its_rounding(family_models, tmp_path) -> None:
    """A mixture of experts must fit its file: 4- to 6-bit attention projections load re-rounded to Q8_0
    (``PackedQ8Linear``), not as fp32; exact mode then equals transformers on those Q8_0 weights."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from fleetllm.models.expert_quant import q8_0_parts

    src, hf = family_models.gguf("qwen3_moe", "f32")
    path = tmp_path / "qwen3-moe-q5-attention.gguf"
    requantise(src, path, {"attn_output": T.Q5_0})
    tensors = {t.name: t for t in read_gguf_file(path).tensors}
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            t = tensors[f"blk.{i}.attn_output.weight"]
            levels, scales = q8_0_parts(np.asarray(t.data), t.tensor_type)
            w = torch.from_numpy(scales).repeat_interleave(32, dim=1) * torch.from_numpy(levels).float()
            layer.self_attn.o_proj.weight.copy_(w)
    model = load_model(str(path)).model
    assert all(isinstance(layer.attn.o, PackedQ8Linear) for layer in model.layers)
    assert_equal_to(ref, greedy(path))
