"""Each row's own adapter update (``lora.c``, and its PyTorch fallback) equals the tables' reference update."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import require_kernels  # tests/ is on the path (pytest's prepend mode)

from fleetllm.kernels import lora
from fleetllm.lora.tables import LoraTables, Shapes, SlotWeights

# odd sizes on purpose: inputs, outputs and ranks that are not multiples of the kernel's vectors
SHAPES = Shapes.of(hidden=72, heads=3, kv_heads=1, head_dim=20, intermediate=100)


@pytest.fixture(scope="module")
def kernel() -> None:
    require_kernels(lora.LIBRARY)


def tables_with(ranks: dict[int, int], modules: tuple[str, ...], seed: int = 0) -> LoraTables:
    """Two layers' tables with an adapter of ``ranks[slot]`` in each slot, adapting ``modules``."""
    g = torch.Generator().manual_seed(seed)
    t = LoraTables(SHAPES, num_layers=2, max_loras=4, max_rank=32)
    for slot, r in ranks.items():
        weights = {}
        for layer in range(2):
            for m in modules:
                fan_in, fan_out = SHAPES.dims[m]
                weights[(layer, m)] = SlotWeights(torch.randn(r, fan_in, generator=g), torch.randn(fan_out, r, generator=g))
        t.set_slot(slot, weights, scaling=0.5)
    return t


@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("slots", [[2], [-1, 0, 2, 0, -1, 3, 3, 0, 2], [1] * 11, [-1, -1]])
def test_kernel_equals_the_reference_update(kernel, vector: bool, slots: list[int]) -> None:
    t = tables_with({0: 5, 1: 12, 2: 16, 3: 9}, ("q_proj", "down_proj"))
    s = torch.tensor(slots, dtype=torch.int32)
    for module in ("q_proj", "down_proj"):
        fan_in, fan_out = SHAPES.dims[module]
        x, y = torch.randn(len(slots), fan_in), torch.randn(len(slots), fan_out)
        want = y + t.delta(1, module, x, s)
        assert lora.lora_kernel(y, x, t.a[1][module], t.b[1][module], s, vector=vector)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


def test_kernel_adds_into_a_column_slice_only(kernel) -> None:
    """The k slice of a fused qkv output: q and v columns, and rows without an adapter, are left as they were."""
    t = tables_with({0: 8, 3: 16}, ("k_proj",))
    s = torch.tensor([0, -1, 3, 3, 0], dtype=torch.int32)
    qkv = torch.randn(5, 60 + 2 * 20)
    x = torch.randn(5, 72)
    before = qkv.clone()
    assert lora.lora_kernel(qkv[:, 60:80], x, t.a[0]["k_proj"], t.b[0]["k_proj"], s)
    torch.testing.assert_close(qkv[:, 60:80], before[:, 60:80] + t.delta(0, "k_proj", x, s), rtol=1e-5, atol=1e-4)
    assert torch.equal(qkv[:, :60], before[:, :60]) and torch.equal(qkv[:, 80:], before[:, 80:])
    assert torch.equal(qkv[1], before[1])


def test_a_slot_outside_the_tables_is_refused(kernel) -> None:
    t = tables_with({0: 4}, ("v_proj",))
    with pytest.raises(ValueError, match="slot outside"):
        lora.lora_kernel(torch.zeros(2, 20), torch.randn(2, 72), t.a[0]["v_proj"], t.b[0]["v_proj"],
                         torch.tensor([0, 4], dtype=torch.int32))


def test_grouped_fallback_equals_the_reference_update() -> None:
    t = tables_with({1: 7, 2: 16}, ("gate_proj",))
    s = torch.tensor([2, -1, 1, 2, 2], dtype=torch.int32)
    x, y = torch.randn(5, 72), torch.randn(5, 100)
    want = y + t.delta(0, "gate_proj", x, s)
    lora.grouped_delta(y, x, t.a[0]["gate_proj"], t.b[0]["gate_proj"], s)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


def test_add_lora_skips_a_projection_no_adapter_adapts() -> None:
    t = tables_with({0: 4}, ("q_proj",))
    y = torch.randn(3, 20)
    before = y.clone()
    assert not lora.add_lora(y, torch.randn(3, 72), t, 0, "v_proj", torch.zeros(3, dtype=torch.int32))
    assert torch.equal(y, before)
