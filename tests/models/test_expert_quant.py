"""A GGUF's expert tensors in the experts kernel's layouts (``fleetllm.models.expert_quant``): 4-bit types (Q4_0,
Q4_1, Q4_K) become 4-bit levels, scales and offsets whose weight is bit for bit gguf-py's dequantisation; 5- and
6-bit types become Q8_0 within half a Q8_0 step of it, MXFP4 Q8_0 levels of exactly its weights; each gate and up
pair shares one layout."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from fleetllm.models.expert_quant import dequantise_q4, expert_layout, expert_parts, layout_parts

E, N, K = 3, 4, 512


def gguf_tensor(qtype: T, seed: int = 0) -> SimpleNamespace:
    """An ``[E, N, K]`` expert tensor of type ``qtype`` as gguf-py's reader holds it (raw block bytes per row)."""
    rng = np.random.default_rng(seed)
    if qtype == T.Q4_K:  # gguf-py has no Q4_K quantiser: random super-blocks (finite fp16 d and dmin)
        blocks = rng.integers(0, 256, (E * N * K // 256, 144), dtype=np.uint8)
        blocks[:, :4] = rng.uniform(0.001, 0.05, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
        data = blocks.reshape(E, N, -1)
    else:
        data = quantize(rng.standard_normal((E, N, K)).astype(np.float32), qtype)
    return SimpleNamespace(data=data, tensor_type=int(qtype))


def parts(t: SimpleNamespace, layout: str) -> list[torch.Tensor]:
    return [torch.cat(list(expert_parts(t, layout, i))) for i in range(len(layout_parts(layout, (E, N, K))))]


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda q: q.name)
def test_4_bit_experts_stay_4_bit_and_dequantise_to_the_files_weights(qtype: T) -> None:
    t = gguf_tensor(qtype)
    layout = expert_layout(qtype)
    levels, factors, scales = parts(t, layout)
    assert levels.dtype == torch.uint8 and levels.shape == (E, N, K // 2) and factors.shape == (E, N, K // 16)
    assert scales.shape == (E, N, K // (128 if qtype == T.Q4_K else 16))  # d, dmin per super-block (Q4_K: 8 groups)
    expected = torch.from_numpy(dequantize(t.data, qtype)).reshape(E, N, K)
    assert torch.equal(dequantise_q4(levels, factors, scales), expected)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda q: q.name)
def test_5_bit_experts_become_q8_0_within_half_its_step(qtype: T) -> None:
    t = gguf_tensor(qtype)
    levels, scales = parts(t, "q8")
    expected = torch.from_numpy(dequantize(t.data, qtype)).reshape(E, N, K // 32, 32)
    got = scales.unsqueeze(-1) * levels.reshape(E, N, K // 32, 32).float()
    assert ((got - expected).abs() <= scales.unsqueeze(-1) * 0.501).all()  # half a step, and the division's rounding


def test_mxfp4_experts_become_q8_0_levels_of_exactly_the_files_weights() -> None:
    t = gguf_tensor(T.MXFP4)
    assert expert_layout(T.MXFP4) == "q8"
    levels, scales = parts(t, "q8")
    assert levels.dtype == torch.int8 and levels.abs().max() <= 12
    expected = torch.from_numpy(dequantize(t.data, T.MXFP4)).reshape(E, N, K // 32, 32)
    assert torch.equal(scales.unsqueeze(-1) * levels.reshape(E, N, K // 32, 32).float(), expected)


def test_q4_k_beside_another_4_bit_type_keeps_its_weights_with_a_scale_pair_per_group() -> None:
    t = gguf_tensor(T.Q4_K)
    expected = torch.from_numpy(dequantize(t.data, T.Q4_K)).reshape(E, N, K)
    assert torch.equal(dequantise_q4(*parts(t, "q4")), expected)


def test_a_gate_and_up_pair_is_4_bit_only_when_both_are() -> None:
    assert expert_layout(T.Q4_K, T.Q4_K) == "q4k" and expert_layout(T.Q4_K, T.Q4_0) == "q4"
    assert expert_layout(T.Q4_K, T.Q6_K) == "q8"
    assert expert_layout(T.Q4_K, T.F32) is None and expert_layout(T.MXFP4, T.F16) is None
