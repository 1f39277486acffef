"""Local disk as a KV tier's store: one file per block, a byte-capped LRU that outlives the worker.

Files live in ``DIR/<namespace>/<hash>.kvb`` (:func:`fleetllm.kvtier.codec.namespace`: one layout per
folder). A block is written to a temporary name and renamed, so a reader sees a whole file or none; at start
the folder is read back (oldest modification first), so a restarted worker serves its previous prefixes. A
read marks the file recent (its modification time too, which the next start reads). Several workers may share
a folder (one node's): each keeps its own byte count, and a file another removed is a miss.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

SUFFIX = ".kvb"


class DiskStore:
    """Stored blocks by hash under ``root``, least recently used removed once ``capacity_bytes`` would be passed.
    Thread-safe: the writer thread puts, the engine thread gets."""

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()
        self._files: OrderedDict[int, int] = OrderedDict()  # hash -> bytes, least recent first
        self.on_removed: Callable[[list[int]], None] | None = None  # told the hashes this store stops holding
        found = []
        for p in self.root.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
                found.append((st.st_mtime_ns, int(p.stem, 16), st.st_size))
            except (OSError, ValueError):  # gone meanwhile, or not ours
                continue
        for _, h, size in sorted(found):
            self._files[h] = size
            self.used_bytes += size
        self._trim(0)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def hashes(self) -> list[int]:
        """The hashes this store holds (its writes, and the files found at start), least recent first."""
        with self._lock:
            return list(self._files)

    def path(self, block_hash: int) -> Path:
        return self.root / f"{block_hash:016x}{SUFFIX}"

    def put(self, block_hash: int, data: bytes) -> None:
        """Store ``data`` under ``block_hash`` (kept already: only marked recent)."""
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
                return
            if len(data) > self.capacity_bytes:
                return
            gone = self._trim(len(data))
        self._removed(gone)
        tmp = self.root / f".{block_hash:016x}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.path(block_hash))
        _stamp(self.path(block_hash))
        with self._lock:
            self._files[block_hash] = len(data)
            self.used_bytes += len(data)

    def get(self, block_hash: int) -> bytes | None:
        """The bytes stored under ``block_hash`` (marked recent), or None."""
        with self._lock:
            if block_hash not in self._files:
                return None
            self._files.move_to_end(block_hash)
        try:
            data = self.path(block_hash).read_bytes()
            _stamp(self.path(block_hash))
            return data
        except OSError:  # removed by another worker sharing the folder
            self.drop(block_hash)
            return None

    def get_many(self, hashes: list[int]) -> list[bytes | None]:
        """The bytes under each of ``hashes`` up to the first absent one (None), in order."""
        out: list[bytes | None] = []
        for h in hashes:
            out.append(self.get(h))
            if out[-1] is None:
                break
        return out

    def drop(self, block_hash: int) -> None:
        """Forget and remove the block under ``block_hash`` (a corrupt one, say)."""
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size
        self.path(block_hash).unlink(missing_ok=True)
        if size is not None:
            self._removed([block_hash])

    def _trim(self, incoming: int) -> list[int]:
        """Remove least recent files until ``incoming`` more bytes fit (lock held); the hashes removed."""
        gone = []
        while self._files and self.used_bytes + incoming > self.capacity_bytes:
            h, size = self._files.popitem(last=False)
            self.used_bytes -= size
            self.path(h).unlink(missing_ok=True)
            gone.append(h)
        return gone

    def _removed(self, hashes: list[int]) -> None:
        if hashes and self.on_removed is not None:
            self.on_removed(hashes)


def _stamp(path: Path) -> None:
    """Mark ``path`` used now, to the nanosecond (the kernel's own stamp is coarser: equal for close uses)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))
