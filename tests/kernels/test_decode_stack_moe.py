"""A Q8_0 GGUF's Qwen3-MoE under the default quantization: its decode steps through the C stack (Q8_0 attention,
per-head q/k norms, the experts kernel) equal its op-by-op steps up to float rounding and count each layer's
experts."""

from __future__ import annotations

import pytest
import torch
from families import converter
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)
from test_decode_stack import decode_step, forward, relative, spy

from fleetllm.kernels import attention, decode_stack, moe_experts, q8
from fleetllm.models.loader import load_model
from fleetllm.models.quant import quantize_model

pytestmark = pytest.mark.skipif(converter() is None, reason="llama.cpp's converter is not unpacked (scripts/setup.sh)")


@pytest.fixture(scope="module")
def moe_model(family_models):
    require_kernels(decode_stack.LIBRARY, q8.LIBRARY, moe_experts.LIBRARY, attention.LIBRARY)
    path, _ = family_models.gguf("qwen3_moe", "q8_0")
    model = quantize_model(load_model(str(path)).model, "q4")
    assert model.decode_stack is not None
    return model


@pytest.mark.parametrize("lens", [[1], [5, 17, 33, 64], [3] * 9])
def test_stack_equals_the_op_by_op_step(moe_model, monkeypatch, lens: list[int]) -> None:
    ids, positions, meta, caches = decode_step(moe_model, lens, torch.float32)
    calls = spy(monkeypatch)
    fused, fused_caches = forward(moe_model, ids, positions, meta, caches, stack=True)
    eager, eager_caches = forward(moe_model, ids, positions, meta, caches, stack=False)
    assert calls == [1]
    # the same Q8_0 GEMV and experts kernel both ways; RMSNorm (the layers' and q/k's) rounds apart, and a last-bit
    # difference may move an activation's int16 level by one (1/32767 of its group's largest input)
    assert relative(fused, eager) < 1e-4
    for fc, ec in zip(fused_caches, eager_caches, strict=True):
        for f, e in zip(fc, ec, strict=True):
            assert relative(f[meta.slot_mapping], e[meta.slot_mapping]) < 1e-4


def test_stack_steps_count_each_layers_experts(moe_model) -> None:
    ids, positions, meta, caches = decode_step(moe_model, [4, 9, 30], torch.float32)
    moes = [layer.mlp for layer in moe_model.layers]
    counted = []
    for stack in (True, False):
        for m in moes:
            m.expert_counts = None
        forward(moe_model, ids, positions, meta, caches, stack=stack)
        counted.append([m.expert_counts for m in moes])
    assert counted[0] == counted[1]
    assert all(sum(c) == 3 * m.top_k for c, m in zip(counted[0], moes, strict=True))
