"""A GGUF's expert tensors (``*_exps``) in the two layouts the experts kernel reads, made one expert at a time.

- **Q8_0** (int8 levels, one fp32 scale per 32 inputs: 1.125 bytes a weight) for Q8_0 experts, bit for bit the
  file's, and for 5- and 6-bit ones (Q5_0, Q5_1, Q5_K, Q6_K), re-rounded to Q8_0 (``amax / 127`` per 32): within
  ``amax / 254`` of the file's weight, a quarter of the 5/6-bit rounding's own step.
- **Q4** (4-bit levels ``q`` in 0..15, two a byte as Q4_0 packs them: byte ``j`` of a group of 32 inputs holds
  input ``j`` in its low nibble and ``j + 16`` in its high one; per group two uint8 factors ``sc``, ``mn``; per
  super-block of ``G`` groups two fp32 ``d``, ``dmin``; the weight is ``(d * sc) * q - dmin * mn``) for Q4_K
  (``G`` 8: its own super-blocks and 6-bit factors, 0.59 bytes a weight against the file's 0.56), Q4_0 (``G`` 1,
  ``sc`` 1, ``mn`` 8, ``dmin = d``) and Q4_1 (``G`` 1, ``sc`` 1, ``mn`` 1, ``dmin = -m``): 0.81 bytes a weight.
  These are the fp32 products gguf-py's dequantisation forms, so the weight (products rounded, then the
  difference) is bit for bit the file's dequantised weight.

- **MXFP4** (GPT-OSS: 32 e2m1 values and one power-of-two scale per block) in Q8_0's layout exactly: the file's
  doubled e2m1 levels (-12..12) are the int8 levels and its scale ``2^(e-128)`` the fp32 one, so every weight is
  the file's (1.125 bytes a weight against 0.53, where fp32 would take 4).

Other types (F32, F16, BF16, ...) are dequantised to fp32 as before. Nothing is materialised whole: the
writer of the converted-weights cache asks for one expert's parts at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fleetllm.models.q8_weights import Q8_LEVELS, Q8_SCALES

Q4_LEVELS, Q4_FACTORS, Q4_SCALES = ".q4", ".q4_factors", ".q4_scale"  # a Q4 tensor's parts in the cache
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K, _MXFP4 = 2, 3, 6, 7, 8, 12, 13, 14, 39  # GGMLQuantizationType
Q4_TYPES = (_Q4_0, _Q4_1, _Q4_K)
Q8_TYPES = (_Q8_0, _Q5_0, _Q5_1, _Q5_K, _Q6_K, _MXFP4)


def expert_layout(*types: int) -> str | None:
    """The layout experts of GGUF types ``types`` share (gate and up are fused: one layout for both): "q4k" (Q4,
    super-blocks of 8 groups) when all are Q4_K, "q4" (Q4, one group each) when all are 4-bit, "q8" when all are
    quantised and one is wider, None (fp32) otherwise."""
    if all(t == _Q4_K for t in types):
        return "q4k"
    if all(t in Q4_TYPES for t in types):
        return "q4"
    if all(t in Q4_TYPES + Q8_TYPES for t in types):
        return "q8"
    return None


def layout_parts(layout: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(suffix, shape, dtype)`` of each part of an ``[E, N, K]`` expert tensor held in ``layout``."""
    lead, k = shape[:-1], shape[-1]
    if layout in ("q4", "q4k"):
        per_super = 8 if layout == "q4k" else 1
        return [(Q4_LEVELS, (*lead, k // 2), torch.uint8), (Q4_FACTORS, (*lead, k // 16), torch.uint8),
                (Q4_SCALES, (*lead, 2 * k // (32 * per_super)), torch.float32)]
    return [(Q8_LEVELS, shape, torch.int8), (Q8_SCALES, (*lead, k // 32), torch.float32)]


def expert_parts(t: Any, layout: str, part: int) -> Iterator[torch.Tensor]:
    """Part ``part`` (see :func:`layout_parts`) of GGUF tensor ``t`` in ``layout``, one expert at a time."""
    data = np.asarray(t.data)
    for e in range(data.shape[0]):
        blocks = data[e].reshape(-1, data.shape[-1])
        n = blocks.shape[0]
        if layout == "q8":
            parts = q8_0_parts(blocks, t.tensor_type)
        else:
            parts = _q4_parts(blocks, t.tensor_type, layout == "q4k")
        yield torch.from_numpy(np.ascontiguousarray(parts[part])).reshape(1, n, -1)


def _q4_parts(rows: np.ndarray, qtype: int, super_blocks: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels ``[n, K/2]``, factors ``sc``, ``mn`` per group ``[n, K/16]`` uint8, ``d``, ``dmin`` per super-block
    ``[n, 2 K/32/G]`` fp32) of raw rows of a 4-bit type; ``super_blocks``: Q4_K's own (``G`` 8), else ``G`` 1."""
    n = rows.shape[0]
    if qtype == _Q4_K:
        levels, factors, d = _q4_k_parts(rows.reshape(-1, 144))
        if not super_blocks:
            d = np.repeat(d.reshape(-1, 1, 2), 8, axis=1)
    else:
        size = 18 if qtype == _Q4_0 else 20
        blocks = rows.reshape(-1, size)
        scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        if qtype == _Q4_0:
            factors, d = np.tile(np.array([1, 8], np.uint8), (len(blocks), 1)), np.concatenate([scale, scale], 1)
        else:
            m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            factors, d = np.ones((len(blocks), 2), np.uint8), np.concatenate([scale, -m], 1)
        levels = blocks[:, size - 16:]
    return levels.reshape(n, -1), factors.reshape(n, -1), d.reshape(n, -1)


def _q4_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (256 inputs: fp16 ``d``, ``dmin``, eight 6-bit scales and mins, 128 bytes where each 64
    inputs' 32 bytes hold inputs 0-31 in their low nibbles and 32-63 in their high ones) as levels ``[B*8, 16]``,
    factors ``[B, 8, 2]``, ``d``/``dmin`` ``[B, 2]``."""
    from gguf.quants import Q4_K

    d = blocks[:, 0:4].copy().view(np.float16).astype(np.float32)  # d, dmin
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 32)  # each 32-input group's levels in input order
    return q[:, :16] | (q[:, 16:] << 4), np.stack([sc, mn], axis=-1).astype(np.uint8), d


def q8_0_parts(rows: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """(levels ``[n, K]`` int8, scales ``[n, K/32]`` fp32) of raw rows: Q8_0's own, or a wider type's weights
    re-rounded to Q8_0."""
    n = rows.shape[0]
    if qtype == _Q8_0:
        blocks = rows.reshape(-1, 34)
        return (blocks[:, 2:].copy().view(np.int8).reshape(n, -1),
                blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, -1))
    if qtype == _MXFP4:
        return _mxfp4_parts(rows.reshape(-1, 17), n)
    from gguf.quants import dequantize

    w = dequantize(rows, qtype).astype(np.float32).reshape(-1, 32)
    top = np.abs(w).max(axis=1, keepdims=True)
    d = top / 127.0
    x = np.divide(w, d, out=np.zeros_like(w), where=d > 0)
    q = (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(np.int8)  # ties away from zero, as llama.cpp rounds
    return q.reshape(n, -1), d.reshape(n, -1)


def _mxfp4_parts(blocks: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 blocks (a byte ``e``, then 32 e2m1 nibbles: inputs 0-15 low, 16-31 high) as Q8_0 levels and scales that
    multiply to gguf-py's dequantised weights exactly (small integers times a power of two)."""
    from gguf.quants import MXFP4

    d = MXFP4.e8m0_to_fp32_half(blocks[:, :1].copy())
    nibbles = blocks[:, 1:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    levels = np.array(MXFP4.kvalues, dtype=np.int8)[(nibbles & 0x0F).reshape(-1, 32)]
    return levels.reshape(n, -1), d.reshape(n, -1)


def dequantise_q4(levels: torch.Tensor, factors: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight ``(d * sc) * q - dmin * mn`` of Q4 parts (``[..., K/2]``, ``[..., K/16]`` uint8,
    ``[..., 2 K/32/G]`` fp32), as gguf-py rounds it."""
    groups = factors.shape[-1] // 2
    f = factors.reshape(*factors.shape[:-1], groups, 2).float()
    d = scales.reshape(*scales.shape[:-1], -1, 2).repeat_interleave(groups // (scales.shape[-1] // 2), dim=-2)
    scale, offset = d[..., 0] * f[..., 0], d[..., 1] * f[..., 1]
    b = levels.reshape(*levels.shape[:-1], groups, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).float()  # inputs 0-15, then 16-31
    return (scale.unsqueeze(-1) * q - offset.unsqueeze(-1)).reshape(*levels.shape[:-1], -1)
