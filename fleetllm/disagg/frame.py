"""The KV transfer frame: a request's prompt blocks, layer-major, with integrity checks.

Layout (little-endian)::

    b"FLKV" | version u16 | header length u32 | header (JSON)
    then for each layer:  crc u32 | K bytes | V bytes       (K, V: [num_blocks, block_size, kv_heads, head_dim])
    b"DONE" | crc of all layer crcs u32

The CRC is CRC-32C (Castagnoli), which CPUs compute in hardware at about a memory copy's speed.

The header names the model, layer count, wire dtype, block size, shape, token ids and block hashes, so a
receiver refuses a frame from another model or layout before touching its pool. The blocks are the full
ones (each hashed) and, when the token ids run past them, one partial block last (the prompt's tail: not
hashed, never a prefix-cache entry; its KV is handed to the request, see :mod:`fleetllm.engine.handoff`). The wire dtype need not
be the pool's (an fp32 pool may ship fp16 frames, half the bytes); the receiver converts on import. An 8-bit
dtype (int8, fp8) ships each row as the cache holds it, ``head_dim`` values and their scales
(:mod:`fleetllm.kernels.kv8`): an 8-bit pool's blocks travel as they are, and a pool of another dtype
dequantises (or quantises) them on import.

Every offset follows from the header, so a frame can be built in place (:class:`FrameBuffer`: a prefill
writes each layer's blocks straight into a shared-memory mapping while later layers still compute) and
read in place (:func:`decode` returns tensor views over the bytes, no copy). A frame is verified
completely before anything is imported: a truncated or corrupted frame imports nothing.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from crc32c import crc32c

from fleetllm.kernels import kv8

MAGIC, TRAILER, VERSION = b"FLKV", b"DONE", 3  # 3: 8-bit rows' float16 scales (2: CRC-32C; 1: zlib's CRC-32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_PREFIX = 10  # magic, version, header length


class FrameError(ValueError):
    """A frame that is truncated, corrupted or does not fit the receiving engine."""


@dataclass
class FrameHeader:
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the wire dtype of K and V (a key of DTYPES)
    block_size: int
    token_ids: list[int]  # the tokens the blocks hold: the full blocks', then a partial block's (fewer than a block)
    block_hashes: list[int]  # of the full blocks
    lora_name: str | None = None  # the adapter the KV was computed with (its hashes are keyed by it); None: base

    @property
    def num_blocks(self) -> int:
        """Blocks in the frame: the full ones and the partial one, if any."""
        return len(self.block_hashes) + (len(self.token_ids) > len(self.block_hashes) * self.block_size)

    @property
    def tail(self) -> list[int]:
        """The tokens of the partial last block (empty: every block is full)."""
        return self.token_ids[len(self.block_hashes) * self.block_size :]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """One layer's K (or V): blocks, block size, KV heads, and each row's elements (8-bit: with its scale)."""
        return self.num_blocks, self.block_size, self.num_kv_heads, kv8.row_width(self.head_dim, DTYPES[self.dtype])

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K (or V)."""
        n = self.shape[0] * self.shape[1] * self.shape[2] * self.shape[3]
        return n * torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def to_json(self) -> dict[str, Any]:
        """The header as JSON-ready fields: a shallow dict (``asdict`` copies a long prompt's token ids one by
        one: 1.5 ms of the prefill worker's event loop for 2,048, holding the GIL its engine thread needs)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["lora_name"] is None:  # a base-model frame's header as before adapters: older readers take it
            del d["lora_name"]
        return d

    @classmethod
    def parse(cls, d: Any) -> FrameHeader:
        """A header from its JSON form; :class:`FrameError` if it is malformed or inconsistent."""
        try:
            header = cls(**d)
        except TypeError as e:
            raise FrameError(f"bad frame header: {e}") from None
        sizes = (header.num_layers, header.num_kv_heads, header.head_dim, header.block_size)
        if not (isinstance(header.model, str) and isinstance(header.lora_name, str | None)
                and all(_count(v) and v > 0 for v in sizes)
                and isinstance(header.token_ids, list) and isinstance(header.block_hashes, list)
                and all(_count(t) for t in header.token_ids) and all(_count(h) for h in header.block_hashes)):
            raise FrameError("bad frame header: sizes must be positive integers, token ids and hashes lists of them")
        if header.dtype not in DTYPES:
            raise FrameError(f"unsupported dtype {header.dtype}")
        if not 0 <= len(header.token_ids) - len(header.block_hashes) * header.block_size < header.block_size:
            raise FrameError("token ids do not fill the blocks (at most one partial block, last)")
        return header

    def head(self) -> bytes:
        """The frame's first bytes: magic, version, header length, header."""
        h = json.dumps(self.to_json()).encode()
        return MAGIC + struct.pack("<HI", VERSION, len(h)) + h

    def frame_bytes(self, head_len: int | None = None) -> int:
        """The whole frame's length."""
        head_len = len(self.head()) if head_len is None else head_len
        return head_len + self.num_layers * (4 + 2 * self.layer_bytes) + 8


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def max_head_bytes(max_tokens: int, block_size: int) -> int:
    """The longest header a frame of at most ``max_tokens`` tokens can have (token ids of up to 10 digits, 64-bit
    hashes, and room for the rest): a receiver reads no more before it knows the frame is one it takes."""
    return _PREFIX + 1024 + 12 * max_tokens + 22 * (max_tokens // block_size + 1)


def _trailer(crcs: list[int]) -> bytes:
    return TRAILER + struct.pack("<I", crc32c(struct.pack(f"<{len(crcs)}I", *crcs)))


def _view(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buf`` (no copy); read-only buffers too: frames are only read from them."""
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # torch warns that a read-only buffer could be written through the tensor
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).view(shape)


class FrameBuffer:
    """A frame built in place in a writable buffer (a shared-memory mapping, or memory to stream).

    Write any layer's blocks in any order through :meth:`layer`, then :meth:`seal` each layer (its CRC,
    over the bytes as written), then :meth:`finish` (the trailer). :meth:`pieces` are the sealed bytes.
    """

    def __init__(self, header: FrameHeader, buf: memoryview | bytearray) -> None:
        self.header = header
        head = header.head()
        self.size = header.frame_bytes(len(head))
        self.mv = memoryview(buf).cast("B")[: self.size]
        if len(self.mv) < self.size:
            raise ValueError(f"buffer of {len(self.mv)} bytes for a frame of {self.size}")
        self.mv[: len(head)] = head
        self._head, self._n = len(head), header.layer_bytes
        self._crcs = [0] * header.num_layers
        dtype = DTYPES[header.dtype]
        self._layers = [(_view(self.mv[o + 4 : o + 4 + self._n], dtype, header.shape),
                         _view(self.mv[o + 4 + self._n : o + 4 + 2 * self._n], dtype, header.shape))
                        for o in map(self._offset, range(header.num_layers))]

    def _offset(self, layer: int) -> int:
        return self._head + layer * (4 + 2 * self._n)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V, ``[num_blocks, block_size, kv_heads, head_dim]`` in the wire dtype, writable."""
        return self._layers[i]

    def put(self, i: int, first: int, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        """Frame blocks ``[first, first + len(index))`` of layer ``i``: ``k`` and ``v`` (``[blocks, ...]``) at ``index``."""
        for src, out in zip((k, v), self._layers[i], strict=True):
            gather_into(src, index, out[first : first + len(index)])

    def seal(self, i: int) -> None:
        """Checksum layer ``i`` as it now stands: nothing may write it afterwards."""
        o = self._offset(i)
        self._crcs[i] = crc32c(self.mv[o + 4 : o + 4 + 2 * self._n])
        struct.pack_into("<I", self.mv, o, self._crcs[i])

    def finish(self) -> None:
        """Write the trailer (every layer sealed)."""
        self.mv[self.size - 8 :] = _trailer(self._crcs)

    def head_piece(self) -> memoryview:
        return self.mv[: self._head]

    def layer_piece(self, i: int) -> memoryview:
        o = self._offset(i)
        return self.mv[o : o + 4 + 2 * self._n]

    def trailer_piece(self) -> memoryview:
        return self.mv[self.size - 8 :]


def gather_into(blocks: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out = blocks[index]`` in ``out``'s dtype, in one copy where the dtypes and devices allow."""
    if out.dtype == blocks.dtype and out.device == blocks.device:
        torch.index_select(blocks, 0, index, out=out)
    else:
        out.copy_(kv8.convert(blocks.index_select(0, index), out.dtype))


def encode(header: FrameHeader, layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[bytes]:
    """Yield the frame piece by piece: the header, then one piece per layer (converted to the header's
    dtype), then the trailer."""
    yield header.head()
    dtype, crcs = DTYPES[header.dtype], []
    for k, v in layers:
        kb, vb = _raw(kv8.convert(k, dtype)), _raw(kv8.convert(v, dtype))
        if len(kb) != header.layer_bytes or len(vb) != header.layer_bytes:
            raise FrameError(f"layer tensor of {len(kb)} bytes, header says {header.layer_bytes}")
        crc = crc32c(vb, crc32c(kb))
        crcs.append(crc)
        yield struct.pack("<I", crc) + kb + vb
    if len(crcs) != header.num_layers:
        raise FrameError(f"{len(crcs)} layers written, header says {header.num_layers}")
    yield _trailer(crcs)


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


class FrameReader:
    """A frame read in place as its bytes arrive: each layer verified on its own, then the trailer.

    ``buf`` holds the frame at its offsets (a mapping, or memory an HTTP body is written into); only the
    head need be there when the reader is made. :meth:`layer` returns views over ``buf`` (no copy). ``check``
    sees the header first (the receiver's :func:`fleetllm.disagg.kv_io.check_fits`): nothing sized by a header
    it refuses is made."""

    def __init__(self, buf: memoryview | bytearray | bytes, check: Callable[[FrameHeader], None] | None = None) -> None:
        self.mv = memoryview(buf).cast("B")
        self.header, self._head = parse_head(self.mv)
        if check is not None:
            check(self.header)
        self._n, self._dtype = self.header.layer_bytes, DTYPES[self.header.dtype]
        self.size = self.header.frame_bytes(self._head)
        self._crcs: list[int | None] = [None] * self.header.num_layers

    def end_of(self, i: int) -> int:
        """Where layer ``i`` ends in the frame (``num_layers``: where the trailer ends, the frame's size)."""
        return self.size if i >= self.header.num_layers else self._head + (i + 1) * (4 + 2 * self._n)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V once its bytes are in, checksum verified."""
        o = self._head + i * (4 + 2 * self._n)
        (crc,) = struct.unpack_from("<I", self.mv, o)
        if crc32c(self.mv[o + 4 : o + 4 + 2 * self._n]) != crc:
            raise FrameError(f"checksum mismatch in layer {i}")
        self._crcs[i] = crc
        return (_view(self.mv[o + 4 : o + 4 + self._n], self._dtype, self.header.shape),
                _view(self.mv[o + 4 + self._n : o + 4 + 2 * self._n], self._dtype, self.header.shape))

    def finish(self) -> None:
        """Check the trailer, every layer verified."""
        if any(c is None for c in self._crcs):
            raise FrameError("a layer was never verified")
        if bytes(self.mv[self.size - 8 : self.size]) != _trailer(self._crcs):  # type: ignore[arg-type]
            raise FrameError("bad trailer (a frame cut short or damaged)")


def decode(data: bytes | bytearray | memoryview) -> tuple[FrameHeader, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Parse and verify a whole frame; raise :class:`FrameError` on any inconsistency.

    The layers are views over ``data`` (no copy), in the frame's dtype: keep ``data`` unchanged while they live."""
    r = FrameReader(data)
    layers = []
    for i in range(r.header.num_layers):
        if len(r.mv) < r.end_of(i):
            raise FrameError(f"truncated frame: layer {i} of {r.header.num_layers} incomplete")
        layers.append(r.layer(i))
    if len(r.mv) != r.size:
        raise FrameError("truncated or overlong frame (no trailer where expected)")
    r.finish()
    return r.header, layers


def head_size(prefix: bytes | memoryview, max_head: int) -> int | None:
    """How many bytes the frame's head (magic to header) takes, from its first bytes (None: not enough yet);
    :class:`FrameError` past ``max_head`` (:func:`max_head_bytes`)."""
    if len(prefix) < _PREFIX:
        return None
    if bytes(prefix[:4]) != MAGIC:
        raise FrameError("not a KV frame (bad magic)")
    size = _PREFIX + struct.unpack_from("<I", prefix, 6)[0]
    if size > max_head:
        raise FrameError(f"a frame header of {size} bytes: at most {max_head} for this engine")
    return size


def parse_head(mv: memoryview) -> tuple[FrameHeader, int]:
    """The frame's header and where its first layer starts."""
    if len(mv) < _PREFIX or bytes(mv[:4]) != MAGIC:
        raise FrameError("not a KV frame (bad magic)")
    version, hlen = struct.unpack_from("<HI", mv, 4)
    if version != VERSION:
        raise FrameError(f"frame version {version}, expected {VERSION}")
    pos = _PREFIX + hlen
    if len(mv) < pos:
        raise FrameError("truncated frame header")
    try:
        d = json.loads(bytes(mv[_PREFIX:pos]))
    except ValueError as e:
        raise FrameError(f"bad frame header: {e}") from None
    return FrameHeader.parse(d), pos
