"""A KV block as stored bytes (the disk and shared tiers), and the namespace that keeps layouts apart.

A stored block is a 32-byte header (magic ``FLKV``, layout version, dtype code, layers, block size, KV heads,
head dim, CRC-32C of what follows), the block's token ids (int32) and its K then V, ``[layers, block_size,
kv_heads, head_dim]`` each in the pool's dtype (an 8-bit pool's rows with their scales, as it holds them: rows
``kv8.row_width(head_dim)`` wide). :func:`decode` refuses anything that is not exactly one
such block, for the layout and the tokens asked (:class:`CorruptBlock`): a value that fails its checksum, is
truncated or belongs to another layout is recomputed, never used.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

import crc32c

from fleetllm.kvtier.host import HostBlock

if TYPE_CHECKING:
    import torch

MAGIC = b"FLKV"
VERSION = 2  # the stored layout: bump when the header, the tensors' order or a row's layout changes (2: 8-bit rows'
# scales became a float16 per 8 channels, as wide as the float32 per 16 of version 1)
_HEADER = struct.Struct("<4sHHIIIII")  # magic, version, dtype, layers, block size, kv heads, head dim, crc32c
# a dtype's code is its index here; 8-bit rows hold head_dim values and their scales (fleetllm.kernels.kv8),
# so a stored block's "head dim" is its rows' width, and the namespace keeps them from other dtypes' blocks
_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2")


class CorruptBlock(ValueError):
    """Stored bytes that are not the block asked for (checksum, length, layout or tokens differ)."""


def namespace(model: str, revision: str | None, dtype: str, block_size: int, shape: tuple[int, int, int]) -> str:
    """A short name for one KV layout: blocks of different models, revisions, dtypes, block sizes or stored
    versions never meet under one key (``shape``: layers, KV heads, head dim)."""
    text = f"{model}|{revision or '-'}|{dtype}|{block_size}|{shape}|v{VERSION}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def encode(block: HostBlock) -> bytes:
    """The stored form of ``block``."""
    import numpy as np

    k, v = block.k.contiguous(), block.v.contiguous()
    layers, bs, heads, dim = k.shape
    tokens = np.asarray(block.token_ids, dtype=np.int32).tobytes()
    body = tokens + _raw(k) + _raw(v)
    code = _DTYPES.index(str(k.dtype).removeprefix("torch."))
    return _HEADER.pack(MAGIC, VERSION, code, layers, bs, heads, dim, crc32c.crc32c(body)) + body


def decode(data: bytes, token_ids: tuple[int, ...], dtype: torch.dtype, shape: tuple[int, int, int, int]) -> HostBlock:
    """The block stored in ``data``, which must hold ``token_ids`` in ``dtype`` and ``shape`` (layers, block
    size, KV heads, head dim); :class:`CorruptBlock` otherwise."""
    import numpy as np
    import torch

    if len(data) < _HEADER.size:
        raise CorruptBlock(f"{len(data)} bytes: shorter than a header")
    magic, version, code, *dims, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or tuple(dims) != shape or code >= len(_DTYPES):
        raise CorruptBlock(f"not a version-{VERSION} block of shape {shape}")
    if getattr(torch, _DTYPES[code]) != dtype:
        raise CorruptBlock(f"a {_DTYPES[code]} block, not {dtype}")
    n = shape[0] * shape[1] * shape[2] * shape[3]
    size = n * torch.empty((), dtype=dtype).element_size()
    body = memoryview(data)[_HEADER.size :]
    if len(body) != 4 * shape[1] + 2 * size:
        raise CorruptBlock(f"{len(body)} bytes of body, not {4 * shape[1] + 2 * size}: truncated")
    if crc32c.crc32c(body) != crc:
        raise CorruptBlock("checksum mismatch")
    if tuple(np.frombuffer(body[: 4 * shape[1]], dtype=np.int32).tolist()) != token_ids:
        raise CorruptBlock("the block holds other tokens")
    raw = bytearray(body[4 * shape[1] :])  # writable: tensors share it
    k = torch.frombuffer(raw, dtype=dtype, count=n).view(shape)
    v = torch.frombuffer(raw, dtype=dtype, count=n, offset=size).view(shape)
    return HostBlock(token_ids, k, v)


def _raw(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes (bf16 included, which numpy cannot hold)."""
    import torch

    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
