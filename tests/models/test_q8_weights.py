"""Weights kept as Q8_0 (fleetllm/models/q8_weights.py): exact-mode products and lookups are those of the fp32
weight the levels and scales stand for."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from fleetllm.models import q8_weights
from fleetllm.models.q8_weights import PackedQ8Embedding, PackedQ8Linear


def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    levels = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return levels, torch.rand(n, k // 32, generator=g).half().float() / 100


def test_a_wide_product_over_a_weight_dequantised_in_pieces_equals_the_whole_weights(monkeypatch) -> None:
    levels, scales = packed(100, 64)
    bias = torch.randn(100)
    linear = PackedQ8Linear(levels, scales, bias)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    whole = F.linear(x, linear.weight, bias)
    monkeypatch.setattr(q8_weights, "CHUNK_WEIGHTS", 64 * 30)  # rows 30 at a time: 4 pieces, the last short
    # the same products, summed in whatever order the matrix kernel picks for each shape: 64 terms of size ~1 differ
    # by a few float32 roundings (1.1e-6 seen), far below a wrong piece's error (~1)
    assert torch.allclose(linear(x), whole, rtol=1e-6, atol=1e-5)


def test_an_embedding_lookup_dequantises_exactly_the_rows_it_reads() -> None:
    levels, scales = packed(50, 64)
    embed = PackedQ8Embedding(levels, scales)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(embed(ids), embed.weight[ids])
    assert torch.equal(embed.weight, (scales.unsqueeze(-1) * levels.view(50, 2, 32).float()).view(50, 64))
