"""Linear layers and token embeddings whose weights stay a GGUF's Q8_0: int8 levels and fp32 scales.

A Q8_0 GGUF's attention projections and token embedding (the tied LM head) load as int8 levels + one fp32
scale per 32 inputs (1.125 bytes a weight, the file's 1.0625), as its experts do (:mod:`fleetllm.models.moe`),
not as fp32 (4 bytes a weight). A product takes the Q8_0 GEMV (activations rounded to int16 per group of 32, as the ``q4``
default's Q4_1 linears round theirs: :func:`fleetllm.kernels.q8.q8_i16_linear`) for steps of fewer than ``q8_rows`` rows: 0 on the loaded model, so exact mode (``--quantization none``) never
takes it; a ``q4`` copy sets it (:mod:`fleetllm.models.quant`). Wider steps multiply by the weight dequantised
for that product (``CHUNK_WEIGHTS`` at a time): bit for bit the fp32 weight the loader used to hold, so exact
mode's outputs are those of a fully dequantised load. An embedding lookup dequantises only the rows it reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.kernels import q8
from fleetllm.models.llama import fuse

Q8_LEVELS, Q8_SCALES = ".q8", ".q8_scale"  # suffixes of a Q8_0 tensor's two parts in the converted-weights cache
# Weights dequantised at once by a wide step (32 MB of fp32): an attention projection in one piece, a large
# vocabulary's LM head in a few, so a wide step never holds the whole head in fp32
CHUNK_WEIGHTS = 8 << 20


def pop_packed(sd: dict[str, torch.Tensor], names: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Q8_0 levels and scales stored for the weights ``names`` (their rows stacked in that order), taken out
    of ``sd``; None when the first is not stored so."""
    if names[0] + Q8_LEVELS not in sd:
        return None
    levels = [sd.pop(n + Q8_LEVELS) for n in names]
    scales = [sd.pop(n + Q8_SCALES) for n in names]
    return fuse(levels), fuse(scales)


class PackedQ8Linear(nn.Module):
    """``x @ W^T (+ bias)`` with ``W`` held as Q8_0 (levels ``q8 [N, K]`` int8, scales ``q8_d [N, K/32]`` fp32)."""

    def __init__(self, levels: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("q8", levels, persistent=False)
        self.register_buffer("q8_d", scales, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = levels.shape
        self.q8_rows = 0  # steps of fewer rows take the Q8_0 GEMV (set on quantised copies)

    @property
    def packed(self) -> q8.Q8Weight:
        """The weight as the Q8_0 kernel reads it (views of this module's buffers)."""
        return q8.Q8Weight(self.q8, self.q8_d)

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 weight, dequantised on each read: for the few readers of a layer's weight (EAGLE's heads)."""
        return self.packed.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features < self.q8_rows:
            y = q8.q8_i16_linear(x, self.packed, self.bias)
            if y is not None:
                return y
        return dequantised_linear(x, self.packed, self.bias)


def dequantised_linear(x: torch.Tensor, weight: q8.Q8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` in fp32 over ``weight`` dequantised, ``CHUNK_WEIGHTS`` at a time."""
    n, k = weight.shape
    step = max(1, CHUNK_WEIGHTS // k)
    if step >= n:
        return F.linear(x, weight.dequantize().to(x.dtype), bias)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, step):
        part = q8.Q8Weight(weight.q[start : start + step], weight.d[start : start + step])
        b = None if bias is None else bias[start : start + step]
        out[..., start : start + step] = F.linear(x, part.dequantize().to(x.dtype), b)
    return out


class PackedQ8Embedding(nn.Module):
    """A token embedding held as Q8_0; a lookup dequantises the rows it reads (bit for bit the fp32 table's)."""

    def __init__(self, levels: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q8", levels, persistent=False)
        self.register_buffer("q8_d", scales, persistent=False)
        self.num_embeddings, self.embedding_dim = levels.shape

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 table, dequantised on each read (EAGLE's training reads its mean)."""
        return q8.Q8Weight(self.q8, self.q8_d).dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = q8.Q8Weight(self.q8.index_select(0, flat), self.q8_d.index_select(0, flat)).dequantize()
        return rows.view(*ids.shape, self.embedding_dim)


def install_packed_embeddings(model: nn.Module, embed: tuple[torch.Tensor, torch.Tensor] | None,
                              head: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Make ``model``'s embedding and LM head Q8_0 modules where the checkpoint kept them so: the loader put
    meta-device placeholders in their place. A tied head shares the embedding's levels (no second copy)."""
    if embed is not None:
        model.embed = PackedQ8Embedding(*embed)
    if model.lm_head.weight.is_meta:  # tied to the packed embedding, or packed itself
        source = embed if model.cfg.tie_word_embeddings or head is None else head
        model.lm_head = PackedQ8Linear(*source)
