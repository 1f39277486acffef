"""A GGUF file's metadata and tensor table, read in one pass over the mapped file.

The ``gguf`` package's reader builds a NumPy view per value: for Gemma 3's 262k-token vocabulary (three
arrays of 262k entries) that is 26 s of CPU before the first weight is read, and 3-5 s for SmolLM2's 49k.
This reader parses the same header with ``struct`` over a ``memoryview`` of the mapped file (the vocabulary
in well under a second) and exposes each tensor's bytes as the ``gguf`` reader does, so
``gguf.quants.dequantize`` takes them unchanged. The format: magic ``GGUF``, version (2 or 3), tensor and
key/value counts, the key/values, the tensor infos, padding to ``general.alignment``, then the tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleetllm.models.config import ModelConfig

# GGUF value types -> struct formats (little-endian); 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain elements; every other type is raw bytes shaped by its block size
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its name, ``gguf.GGMLQuantizationType``, GGUF-order dims and a read-only view of its data
    (elements for plain types, bytes with the last dimension in bytes for block-quantised ones)."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """Metadata (every key/value as Python values; arrays as lists) and tensors of a GGUF file."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]

    def model_config(self) -> ModelConfig:
        """The model's config from its metadata (tied when the file has no separate ``output.weight``) and Phi-3's
        longrope factor tensors."""
        meta = self.metadata
        vocab = int(meta.get(f"{meta['general.architecture']}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
        names = {t.name: t for t in self.tensors}
        factors = {k: np.asarray(names[f"rope_factors_{k}.weight"].data, np.float32).tolist()
                   for k in ("long", "short") if f"rope_factors_{k}.weight" in names}
        return ModelConfig.from_gguf(meta, vocab, tied="output.weight" not in names, rope_factors=factors)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return str(self.buf[self.pos - n:self.pos], "utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(self.unpack("<I"), self.unpack("<Q"))
        return self.unpack(_SCALARS[kind])

    def array(self, kind: int, n: int) -> list[Any]:
        if kind in _SCALARS:  # numbers in one call
            fmt = _SCALARS[kind]
            values = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.pos))
            self.pos += n * struct.calcsize(fmt)
            return values
        return [self.value(kind) for _ in range(n)]


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header and tensor table; tensor data stays in the file's read-only mapping."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(mapped))
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("<I"), cur.unpack("<Q"), cur.unpack("<Q")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    whole = np.frombuffer(mapped, dtype=np.uint8)
    tensors = []
    for name, dims, kind, offset in infos:
        ggml_type = GGMLQuantizationType(kind)
        n = int(np.prod(dims))
        np_dims = tuple(reversed(dims))
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind])
            data = whole[start + offset:start + offset + n * dtype.itemsize].view(dtype).reshape(np_dims)
        else:
            block, size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n // block * size
            data = whole[start + offset:start + offset + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * size)
        tensors.append(GGUFTensor(name, ggml_type, dims, data))
    return GGUFFile(metadata, tensors)
