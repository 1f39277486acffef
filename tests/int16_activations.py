"""The int16 activation contract of the Q8_0 kernels (``q8_i16_rows.h``), as a reference computes it."""

from __future__ import annotations

import torch


def int16_rounded(v: torch.Tensor) -> torch.Tensor:
    """``v`` (fp32, last dimension a multiple of 32) as the kernels round activations, in fp64: per group of 32,
    levels ``round(v * (32767 / max|v|))`` times the scale ``max|v| / 32767``, each step in fp32 as the C code
    computes it."""
    g = v.float().reshape(-1, 32)
    top = g.abs().amax(dim=1, keepdim=True)
    inv = torch.where(top > 0, 32767 / top, torch.zeros_like(top))
    return (torch.round(g * inv).double() * (top / 32767).double()).reshape(v.shape)
