"""The quantised kernels stay close to fp32, each regime takes its kernel, and the loaded model stays fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetllm.models.quant import WIDE_ROWS, ByWidth, Int4Linear, Int8DynamicLinear, Int8Linear, quantize_int4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def test_int4_reproduces_a_groupwise_int4_weight_up_to_bf16_rounding() -> None:
    torch.manual_seed(0)
    levels = torch.randint(0, 16, (64, 128)).float()
    levels[:, ::32], levels[:, 1::32] = 0, 15  # every group spans the full int4 range
    scale = torch.rand(64, 4).repeat_interleave(32, dim=1) * 0.1 + 0.01
    w = levels * scale - 0.3  # exactly representable as asymmetric int4 per group of 32
    lin = nn.Linear(128, 64, bias=False)
    lin.weight.data = w
    x = torch.randn(3, 128).bfloat16().float()  # the int4 path feeds bf16 activations
    assert rel_err(Int4Linear(lin)(x), x @ w.T) < 0.05  # bf16 scales/zeros: a few percent


def test_int8_kernels_are_close_to_fp32() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 500, bias=True)
    x = torch.randn(16, 96)
    ref = lin(x)
    assert rel_err(Int8Linear(lin)(x), ref) < 0.02
    assert rel_err(Int8DynamicLinear(lin)(x), ref) < 0.03  # 7-bit activations (fbgemm without VNNI)


def test_dynamic_int8_scales_activations_per_token() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(WIDE_ROWS, 64)
    x[0] *= 1000  # one loud token must not coarsen the others
    out, ref = Int8DynamicLinear(lin)(x), lin(x)
    assert rel_err(out[1:], ref[1:]) < 0.03  # per tensor, the quiet rows would get about 1 level of 127


def test_each_width_takes_its_kernel() -> None:
    calls = []
    narrow = lambda x: calls.append("narrow") or x  # noqa: E731
    wide = lambda x: calls.append("wide") or x  # noqa: E731
    layer = ByWidth(nn.Identity(), nn.Identity())
    layer.narrow.forward, layer.wide.forward = narrow, wide
    layer(torch.zeros(WIDE_ROWS - 1, 4))
    layer(torch.zeros(WIDE_ROWS, 4))
    assert calls == ["narrow", "wide"]


def test_scales_and_zeros_layout() -> None:
    packed, sz = quantize_int4(torch.randn(64, 96))
    assert sz.shape == (3, 64, 2) and sz.dtype == torch.bfloat16


def test_quantizing_leaves_the_loaded_model_unchanged_and_drops_fp32_decoder_weights(loaded_model) -> None:
    from fleetllm.models.quant import quantize_model

    model = loaded_model.model
    q = quantize_model(model, "int4-int8")
    assert quantize_model(model, "int4-int8") is q  # one copy per model and method
    assert isinstance(model.layers[0].mlp.down, nn.Linear) and isinstance(model.lm_head, nn.Linear)
    assert isinstance(q.layers[0].mlp.down, ByWidth) and q.layers[0].mlp.down.weight is None
    assert q.embed is model.embed and q.lm_head.weight is model.lm_head.weight
    assert quantize_model(model, "none") is model


def test_a_quantised_copy_given_again_is_not_quantised_twice(loaded_model) -> None:
    """Engines over one loaded model (``loaded=``) pass an engine's quantised copy back in."""
    from fleetllm.models.quant import quantize_model

    model = loaded_model.model
    q = quantize_model(model, "int4")
    assert quantize_model(q, "int4") is q
    assert quantize_model(q, "none") is model
    assert quantize_model(q, "int4-int8") is quantize_model(model, "int4-int8")


def test_q4_linear_serves_fp32_until_its_kernel_is_built() -> None:
    from fleetllm.kernels import q4
    from fleetllm.kernels.q4_int import BlockedQ4
    from fleetllm.models.quant import Q4Linear

    lin = nn.Linear(64, 24, bias=True)
    levels = torch.randint(0, 16, (24, 2, 32)).float()
    levels[..., 0], levels[..., 1] = 0, 15  # each group's extremes at the end levels, as ggml quantises
    lin.weight.data = (levels * 0.015625 - 0.125).reshape(24, 64)  # exactly Q4_1: d = 2^-6, m = -1/8
    layer = Q4Linear(lin, BlockedQ4.of(q4.recover_q4_1(lin.weight)), 16)
    x = torch.randn(3, 64)
    q4.set_kernel_enabled(False)
    try:
        assert torch.equal(layer(x), lin(x))
    finally:
        q4.set_kernel_enabled(True)


def test_q4_keeps_the_q4_1_decoder_weights_and_the_q8_0_head(loaded_model) -> None:
    from fleetllm.kernels import bf16
    from fleetllm.models.quant import (
        BF16_ROWS,
        INT16_WIDE_ROWS,
        Q4_WIDE_ROWS,
        BF16Linear,
        Q4Linear,
        Q8Linear,
        quantize_model,
    )

    model = loaded_model.model
    q = quantize_model(model, "q4")
    down, fp32_down = q.layers[0].mlp.down, model.layers[0].mlp.down
    assert isinstance(down, ByWidth) and isinstance(down.narrow, Q4Linear) and down.narrow.bits == 16
    assert torch.equal(down.narrow.q4.unblock().dequantize(), fp32_down.weight)  # the GGUF's Q4_1
    head = q.lm_head  # Q8_0 in the GGUF, tied to the embedding: the fp32 weight stays shared, unchanged
    assert isinstance(head, ByWidth) and isinstance(head.narrow, Q8Linear)
    assert head.weight is model.lm_head.weight and isinstance(model.lm_head, nn.Linear)
    assert torch.equal(head.narrow.q8.dequantize(), model.lm_head.weight)
    if bf16.cpu_has_bf16():  # wide steps: the same weights rounded to bf16
        assert isinstance(down.wide, BF16Linear) and down.rows == BF16_ROWS
        assert isinstance(head.wide, BF16Linear) and head.rows == BF16_ROWS
        assert torch.equal(down.wide.w16.unpair(), fp32_down.weight.bfloat16())
        assert torch.equal(head.wide.w16.unpair(), model.lm_head.weight.bfloat16())
    else:  # fp32 ones
        assert down.wide is fp32_down and down.rows == INT16_WIDE_ROWS
        assert head.wide is model.lm_head and head.rows == Q4_WIDE_ROWS


def test_q4_q8_rounds_activations_to_int8_at_every_width(loaded_model) -> None:
    from fleetllm.models.quant import Q4Linear, quantize_model

    q = quantize_model(loaded_model.model, "q4-q8")
    down = q.layers[0].mlp.down
    assert isinstance(down, Q4Linear) and down.bits == 8
    if q.decode_stack is not None:
        assert q.decode_stack.bits == 8


def test_batch_invariant_q4_takes_the_narrow_kernels_at_every_width(loaded_model) -> None:
    from fleetllm.models.quant import Q4Linear, Q8Linear, quantize_model

    q = quantize_model(loaded_model.model, "q4", batch_invariant=True)
    assert q is not quantize_model(loaded_model.model, "q4")
    assert isinstance(q.layers[0].mlp.down, Q4Linear) and q.layers[0].mlp.down.bits == 16
    assert isinstance(q.lm_head, Q8Linear)
    assert quantize_model(q, "q4", batch_invariant=True) is q
    with pytest.raises(ValueError, match="batch_invariant is not implemented for quantization 'int4'"):
        quantize_model(loaded_model.model, "int4", batch_invariant=True)


def test_batch_invariant_output_does_not_depend_on_the_batch(loaded_model) -> None:
    from fleetllm import LLM, SamplingParams
    from fleetllm.kernels import wait_for_kernels

    wait_for_kernels()  # not the fp32 fallback for the first run's steps
    tok = loaded_model.tokenizer
    prompts = [tok.encode(f"Write a short note about the number {i}.") for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(loaded=loaded_model, quantization="q4", batch_invariant=True, num_blocks=128)
    alone = llm.generate([prompts[0]], params)[0].outputs[0]
    batched = llm.generate(prompts, params)[0].outputs[0]  # 8 rows a step: q4 would take its wide kernels
    assert batched.token_ids == alone.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(batched.logprobs, alone.logprobs, strict=True)) < 1e-4


def test_batch_invariant_short_prompts_take_the_stacks_attention_off_the_stack_too(loaded_model, monkeypatch) -> None:
    """A prompt short enough for the decode stack reads the cache through the decode kernel when its step runs
    op by op (a P/D prefill watched layer by layer): the same attention arithmetic either way. Without
    ``batch_invariant`` such a chunk takes the prefill kernel."""
    from fleetllm.kernels import wait_for_kernels
    from fleetllm.kernels.decode_stack import MAX_CHUNK_KEYS
    from fleetllm.kernels.prefill import prefill_ready
    from fleetllm.models import llama
    from fleetllm.models.quant import quantize_model

    wait_for_kernels()
    if quantize_model(loaded_model.model, "q4", batch_invariant=True).decode_stack is None:
        pytest.skip("no decode stack on this CPU")
    if not prefill_ready(torch.zeros(1, 9, 64), torch.zeros(1, 3, 64)):
        pytest.skip("no prefill kernel on this CPU")
    used = []
    real = llama.prefill_attention
    monkeypatch.setattr(llama, "prefill_attention", lambda *a, **kw: used.append(1) or real(*a, **kw))
    cfg, n = loaded_model.config, 40
    table = torch.arange(4, dtype=torch.int32)
    slots = torch.arange(n)
    cache = [(torch.zeros(64, cfg.num_kv_heads, cfg.head_dim), torch.zeros(64, cfg.num_kv_heads, cfg.head_dim))
             for _ in range(cfg.num_layers)]
    chunk = llama.PrefillChunk(0, n, slots, fresh=True, block_table=table, context_len=n)
    meta = llama.AttentionMetadata(slot_mapping=slots, prefills=[chunk], block_size=16, layer_by_layer=True)
    ids = torch.arange(100, 100 + n)
    for invariant, prefill_kernel in ((True, False), (False, True)):
        used.clear()
        model = quantize_model(loaded_model.model, "q4", batch_invariant=invariant)
        assert model.layers[0].attn.in_place_chunk_keys == (MAX_CHUNK_KEYS if invariant else 0)
        model(ids, torch.arange(n), meta, cache)
        assert bool(used) == prefill_kernel
