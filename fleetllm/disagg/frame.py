"""The KV transfer frame: a request's full prompt blocks, layer-major, with integrity checks.

Layout (little-endian)::

    b"FLKV" | version u16 | header length u32 | header (JSON)
    then for each layer:  crc32 u32 | K bytes | V bytes       (K, V: [num_blocks, block_size, kv_heads, head_dim])
    b"DONE" | crc32 of all layer crcs u32

The header names the model, layer count, dtype, block size, shape, token ids and block hashes, so a
receiver refuses a frame from another model or layout before touching its pool. A frame is written
layer by layer (a sender can stream it while it serialises) and read completely and verified before
anything is imported: a truncated or corrupted frame imports nothing.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

MAGIC, TRAILER, VERSION = b"FLKV", b"DONE", 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FrameError(ValueError):
    """A frame that is truncated, corrupted or does not fit the receiving engine."""


@dataclass
class FrameHeader:
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    token_ids: list[int]  # the tokens the blocks hold (num_blocks * block_size of them)
    block_hashes: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def layer_bytes(self) -> int:
        itemsize = torch.empty((), dtype=_DTYPES[self.dtype]).element_size()
        return self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def encode(header: FrameHeader, layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[bytes]:
    """Yield the frame piece by piece: the header, then one piece per layer, then the trailer."""
    h = json.dumps(asdict(header)).encode()
    yield MAGIC + struct.pack("<HI", VERSION, len(h)) + h
    crcs = []
    for k, v in layers:
        kb, vb = _raw(k), _raw(v)
        if len(kb) != header.layer_bytes or len(vb) != header.layer_bytes:
            raise FrameError(f"layer tensor of {len(kb)} bytes, header says {header.layer_bytes}")
        crc = zlib.crc32(vb, zlib.crc32(kb))
        crcs.append(crc)
        yield struct.pack("<I", crc) + kb + vb
    if len(crcs) != header.num_layers:
        raise FrameError(f"{len(crcs)} layers written, header says {header.num_layers}")
    yield TRAILER + struct.pack("<I", zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs)))


def decode(data: bytes | memoryview) -> tuple[FrameHeader, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Parse and verify a whole frame; raise :class:`FrameError` on any inconsistency."""
    mv = memoryview(data)
    if len(mv) < 10 or bytes(mv[:4]) != MAGIC:
        raise FrameError("not a KV frame (bad magic)")
    version, hlen = struct.unpack_from("<HI", mv, 4)
    if version != VERSION:
        raise FrameError(f"frame version {version}, expected {VERSION}")
    pos = 10 + hlen
    if len(mv) < pos:
        raise FrameError("truncated frame header")
    try:
        header = FrameHeader(**json.loads(bytes(mv[10:pos])))
    except (ValueError, TypeError) as e:
        raise FrameError(f"bad frame header: {e}") from None
    if header.dtype not in _DTYPES:
        raise FrameError(f"unsupported dtype {header.dtype}")
    if len(header.token_ids) != header.num_blocks * header.block_size:
        raise FrameError("token ids do not fill the blocks")
    n = header.layer_bytes
    shape = (header.num_blocks, header.block_size, header.num_kv_heads, header.head_dim)
    dtype = _DTYPES[header.dtype]
    layers, crcs = [], []
    for layer in range(header.num_layers):
        if len(mv) < pos + 4 + 2 * n:
            raise FrameError(f"truncated frame: layer {layer} of {header.num_layers} incomplete")
        (crc,) = struct.unpack_from("<I", mv, pos)
        kb, vb = mv[pos + 4 : pos + 4 + n], mv[pos + 4 + n : pos + 4 + 2 * n]
        if zlib.crc32(vb, zlib.crc32(kb)) != crc:
            raise FrameError(f"checksum mismatch in layer {layer}")
        crcs.append(crc)
        layers.append((_tensor(kb, dtype, shape), _tensor(vb, dtype, shape)))
        pos += 4 + 2 * n
    if len(mv) != pos + 8 or bytes(mv[pos : pos + 4]) != TRAILER:
        raise FrameError("truncated or overlong frame (no trailer where expected)")
    (total,) = struct.unpack_from("<I", mv, pos + 4)
    if total != zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs)):
        raise FrameError("trailer checksum mismatch")
    return header, layers


def _tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.frombuffer(buf, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
    np_dtype = np.float32 if dtype == torch.float32 else np.float16
    return torch.from_numpy(np.frombuffer(buf, dtype=np_dtype).copy()).reshape(shape)
