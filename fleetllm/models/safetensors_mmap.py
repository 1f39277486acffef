"""A safetensors file as tensors that are views of one memory map of the file: nothing is read until used;
and the writer that makes such a file one tensor at a time.

Every tensor shares one storage (the map), so tensors that lie back to back in the file can be joined into
one tensor without a copy (:func:`fleetllm.models.llama.fuse`); ``safetensors.torch.load_file`` maps the file
too but gives each tensor a storage of its own. The map is private (copy-on-write): a write to a weight
would never reach the cached file. Its pages are the page cache's, shared by every worker on the node that
serves the same file.

Format: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
(offsets relative to the end of the header), then the data.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

LazyTensor = tuple[str, tuple[int, ...], Callable[[], Iterable[torch.Tensor]]]
"""A tensor's name, its shape, and what makes it when the writer reaches it: blocks of its outermost rows
(one block or many) whose concatenation is the tensor."""


def write_safetensors(path: Path, tensors: list[LazyTensor], dtypes: dict[str, torch.dtype] | None = None) -> None:
    """Write tensors (fp32, or the dtype ``dtypes`` names for a tensor) as a safetensors file, making each only when its turn comes and writing its
    blocks straight from their own memory (``safetensors.torch.save_file`` first copies everything into
    one bytes object): the peak is one block, not the model twice over. Sorted by name, as safetensors does, so
    that a layer's gate and up projections lie side by side for :func:`fleetllm.models.llama.fuse`."""
    tensors = sorted(tensors, key=lambda t: t[0])
    dtypes = dtypes or {}
    header, offset = {}, 0
    for name, shape, _ in tensors:
        dtype = dtypes.get(name, torch.float32)
        size = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, make in tensors:
            end = f.tell() + header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            for block in make():
                block.to(dtypes.get(name, torch.float32)).contiguous().numpy().tofile(f)
            if f.tell() != end:
                raise ValueError(f"{name}: made {f.tell() - end:+d} bytes off what its shape {shape} holds")
        f.flush()
        os.fsync(f.fileno())


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, as views of one private memory map of it."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        if f.seek(0, 2) == 8 + header_len:  # no data (mmap refuses an empty range past the header)
            return {}
        # Not MAP_POPULATE: mapping every page up front measured no faster than faulting them in on first use
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = torch.frombuffer(mm, dtype=torch.uint8)  # holds the map open as long as any view lives
    base, out = 8 + header_len, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which fleetllm does not read")
        out[name] = data[base + start:base + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out
