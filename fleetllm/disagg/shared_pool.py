"""A decode worker's KV pool as other processes on its host see it: its layout, and writable mappings of it.

The decode worker keeps its pool in a shared-memory file (:mod:`fleetllm.engine.kv_memory`) laid out as the
model runner holds it: ``[2 * num_layers, num_blocks, block_size, kv_heads, head_dim]``, K of layer ``i`` at
``2i`` and V at ``2i + 1``. :class:`PoolLayout` says so in a reservation's answer; :class:`PoolMaps` (prefill
side) maps the file once and keeps the mapping while the file exists and its worker runs: mapping is cheap,
but a mapping of a pool whose worker is gone would keep the whole pool's memory alive.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fleetllm.disagg.frame import DTYPES
from fleetllm.engine.kv_memory import POOL_PREFIX, alive, pool_owner, remove_stale_pools, shm_dir
from fleetllm.kernels import kv8

if TYPE_CHECKING:
    from fleetllm.engine.kv_connector.access import BlockAccess

Layers = list[tuple[torch.Tensor, torch.Tensor]]
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python names it from 3.12 on


@dataclass(frozen=True)
class PoolLayout:
    """Where a shared KV pool is and how its bytes are laid out."""

    path: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of frame.DTYPES

    @classmethod
    def of(cls, blocks: BlockAccess, path: Path) -> PoolLayout:
        """The layout of an engine's pool (``blocks``: its KV connector's access), kept in the file ``path``."""
        views = blocks.kv_blocks()
        k = views[0][0]
        return cls(str(path), len(views), *k.shape[:-1], kv8.head_dim_of(k), str(k.dtype).removeprefix("torch."))

    @classmethod
    def parse(cls, d: Any) -> PoolLayout:
        """A layout from a reservation's answer; ValueError unless it names a pool file and a known dtype."""
        try:
            layout = cls(**d)
        except TypeError as e:
            raise ValueError(f"bad pool layout: {e}") from None
        p = Path(layout.path)
        if p.parent != shm_dir() or not p.name.startswith(POOL_PREFIX) or layout.dtype not in DTYPES:
            raise ValueError(f"not a KV pool file of this host: {layout.path} ({layout.dtype})")
        return layout

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def nbytes(self) -> int:
        n = 2 * self.num_layers * self.num_blocks * self.block_size * self.num_kv_heads * self.row
        return n * torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def row(self) -> int:
        """Elements of one (slot, KV head) row: ``head_dim``, and the scale's bytes in an 8-bit pool."""
        return kv8.row_width(self.head_dim, DTYPES[self.dtype])


class PoolMaps:
    """Writable mappings of decode workers' pool files, one per file while it exists and its worker runs."""

    def __init__(self) -> None:
        # per file: its (device, inode), the mapping, its per-layer views, the blocks whose pages it maps already
        self._maps: dict[str, tuple[tuple[int, int], mmap.mmap, Layers, set[int]]] = {}
        self._lock = threading.Lock()

    def layers(self, layout: PoolLayout) -> Layers:
        """Per layer, K and V views ``[num_blocks, block_size, kv_heads, head_dim]`` of the pool (writable)."""
        st = os.stat(layout.path)
        if st.st_size != layout.nbytes:
            raise ValueError(f"{layout.path}: {st.st_size} bytes, its layout says {layout.nbytes}")
        with self._lock:
            self._prune()
            held = self._maps.get(layout.path)
            if held is not None and held[0] == (st.st_dev, st.st_ino):
                return held[2]
        fd = os.open(layout.path, os.O_RDWR)
        try:  # no MAP_POPULATE: the pool is sparse, touching all of it would allocate all of it
            m = mmap.mmap(fd, layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        t = torch.frombuffer(m, dtype=DTYPES[layout.dtype]).view(
            2 * layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.row)
        views = [(t[2 * i], t[2 * i + 1]) for i in range(layout.num_layers)]
        with self._lock:
            self._maps[layout.path] = ((st.st_dev, st.st_ino), m, views, set())
        return views

    def prefault(self, layout: PoolLayout, blocks: list[int]) -> None:
        """Map ``blocks``' pages (every layer's K and V) into this process ahead of the writes, so that the
        engine thread's writes do not take a page fault per 4 KiB (``MADV_POPULATE_WRITE``: nothing is
        written; pages not yet allocated are allocated zeroed). Any thread; a kernel without it: no-op.

        Through libc by ctypes, which lets go of the GIL for the call: ``mmap.madvise`` holds it, and faulting
        in a 2,048-token prompt's 94 MB takes 15-70 ms that the engine thread's prefill would wait out. A
        block done once stays mapped (the mapping is kept, the pool never gives pages back): it is skipped,
        where walking its pages again would still cost 4-7 ms a prompt (on a pinned worker, its core's)."""
        with self._lock:
            held = self._maps.get(layout.path)
            if held is None:
                return
            mapped = held[3]
            todo = sorted({b for b in blocks if b >= 0} - mapped)
        base, per_block = held[2][0][0].data_ptr(), layout.nbytes // (2 * layout.num_layers * layout.num_blocks)
        for first, count in _runs(todo):
            for half in range(2 * layout.num_layers):
                start = (half * layout.num_blocks + first) * per_block
                aligned = start - start % mmap.PAGESIZE
                if _libc().madvise(ctypes.c_void_p(base + aligned), ctypes.c_size_t(start + count * per_block - aligned),
                                   MADV_POPULATE_WRITE) != 0:
                    return  # before Linux 5.14: the writes fault the pages in themselves
        with self._lock:
            mapped.update(todo)

    def forget(self, path: str) -> None:
        """Drop the mapping of ``path`` (its worker failed): unmapped once no transfer writes through it."""
        with self._lock:
            self._maps.pop(path, None)

    def _prune(self) -> None:
        for path in [p for p in self._maps if not _usable(Path(p))]:
            del self._maps[path]
        remove_stale_pools(shm_dir())


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted block ids as runs ``(first, count)`` of consecutive ones."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return [(a, n) for a, n in runs]


def _usable(p: Path) -> bool:
    pid = pool_owner(p)
    return p.exists() and (pid is None or alive(pid))
