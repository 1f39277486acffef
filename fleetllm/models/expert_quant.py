"""A GGUF's expert tensors (``*_exps``) in the two layouts the experts kernel reads, made one expert at a time.

- **Q8_0** (int8 levels, one fp32 scale per 32 inputs: 1.125 bytes a weight) for Q8_0 experts, bit for bit the
  file's, and for 5- and 6-bit ones (Q5_0, Q5_1, Q5_K, Q6_K), re-rounded to Q8_0 (``amax / 127`` per 32): within
  ``amax / 254`` of the file's weight, a quarter of the 5/6-bit rounding's own step.
- **Q4** (4-bit levels ``q`` in 0..15, two a byte as Q4_0 packs them: byte ``j`` of a group holds input ``j``
  in its low nibble and ``j + 16`` in its high one; one fp32 scale ``d`` and one fp32 offset ``m`` per 32 inputs;
  the weight is ``d * q + m``: 0.75 bytes a weight) for Q4_0 (``m = -8d``), Q4_1 and Q4_K (each 32-input
  sub-block's ``d * sc`` and ``-dmin * min``). The same fp32 products gguf-py's dequantisation forms, so the
  weight ``d * q + m`` (a product rounded, then a sum) is bit for bit the file's dequantised weight.

Other types (F32, F16, BF16, MXFP4, ...) are dequantised to fp32 as before. Nothing is materialised whole: the
writer of the converted-weights cache asks for one expert's parts at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fleetllm.models.q8_weights import Q8_LEVELS, Q8_SCALES

Q4_LEVELS, Q4_SCALES, Q4_OFFSETS = ".q4", ".q4_scale", ".q4_min"  # a Q4 tensor's parts in the cache
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # gguf.GGMLQuantizationType
Q4_TYPES = (_Q4_0, _Q4_1, _Q4_K)
Q8_TYPES = (_Q8_0, _Q5_0, _Q5_1, _Q5_K, _Q6_K)


def expert_layout(*types: int) -> str | None:
    """The layout experts of GGUF types ``types`` share (gate and up are fused: one layout for both): "q4" when all
    are 4-bit, "q8" when all are quantised and one is wider, None (fp32) otherwise."""
    if all(t in Q4_TYPES for t in types):
        return "q4"
    if all(t in Q4_TYPES + Q8_TYPES for t in types):
        return "q8"
    return None


def layout_parts(layout: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(suffix, shape, dtype)`` of each part of an ``[E, N, K]`` expert tensor held in ``layout``."""
    groups = (*shape[:-1], shape[-1] // 32)
    if layout == "q4":
        return [(Q4_LEVELS, (*shape[:-1], shape[-1] // 2), torch.uint8), (Q4_SCALES, groups, torch.float32),
                (Q4_OFFSETS, groups, torch.float32)]
    return [(Q8_LEVELS, shape, torch.int8), (Q8_SCALES, groups, torch.float32)]


def expert_parts(t: Any, layout: str, part: int) -> Iterator[torch.Tensor]:
    """Part ``part`` (see :func:`layout_parts`) of GGUF tensor ``t`` in ``layout``, one expert at a time."""
    data = np.asarray(t.data)
    for e in range(data.shape[0]):
        blocks = data[e].reshape(-1, data.shape[-1])
        n = blocks.shape[0]
        parts = _q4_parts(blocks, t.tensor_type) if layout == "q4" else _q8_parts(blocks, t.tensor_type)
        yield torch.from_numpy(np.ascontiguousarray(parts[part])).reshape(1, n, -1)


def _q4_parts(rows: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels ``[n, K/2]`` uint8, scales and offsets ``[n, K/32]`` fp32) of raw rows of a 4-bit type."""
    n = rows.shape[0]
    if qtype == _Q4_K:
        return _q4_k_parts(rows.reshape(-1, 144), n)
    size = 18 if qtype == _Q4_0 else 20
    blocks = rows.reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    m = -8.0 * d if qtype == _Q4_0 else blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return blocks[:, size - 16:].reshape(n, -1), d.reshape(n, -1), m.reshape(n, -1)


def _q4_k_parts(blocks: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (256 inputs: fp16 ``d``, ``dmin``, eight 6-bit scales and mins, 128 bytes where each 64
    inputs' 32 bytes hold inputs 0-31 in their low nibbles and 32-63 in their high ones) as 32-input Q4 groups."""
    from gguf.quants import Q4_K

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d * sc.astype(np.float32)  # [blocks, 8]: gguf-py's products
    offset = -(dmin * mn.astype(np.float32))
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 32)  # each 32-input group's levels in input order
    packed = q[:, :16] | (q[:, 16:] << 4)
    return packed.reshape(n, -1), scale.reshape(n, -1), offset.reshape(n, -1)


def _q8_parts(rows: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """(levels ``[n, K]`` int8, scales ``[n, K/32]`` fp32) of raw rows: Q8_0's own, or a wider type's weights
    re-rounded to Q8_0."""
    n = rows.shape[0]
    if qtype == _Q8_0:
        blocks = rows.reshape(-1, 34)
        return (blocks[:, 2:].copy().view(np.int8).reshape(n, -1),
                blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, -1))
    from gguf.quants import dequantize

    w = dequantize(rows, qtype).astype(np.float32).reshape(-1, 32)
    top = np.abs(w).max(axis=1, keepdims=True)
    d = top / 127.0
    q = np.round(np.divide(w, d, out=np.zeros_like(w), where=d > 0)).astype(np.int8)
    return q.reshape(n, -1), d.reshape(n, -1)


def dequantise_q4(levels: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The fp32 weight ``d * q + m`` of Q4 parts (``[..., K/2]`` uint8, ``[..., K/32]`` fp32 twice)."""
    b = levels.reshape(*scales.shape, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).float()  # inputs 0-15, then 16-31
    return (scales.unsqueeze(-1) * q + offsets.unsqueeze(-1)).reshape(*levels.shape[:-1], -1)
