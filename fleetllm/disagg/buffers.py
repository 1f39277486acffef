"""Memory for frames being built on a prefill worker, reused from one transfer to the next.

Fresh memory costs page faults on first touch (on a VM, more than the copy itself), so a prefill
worker keeps the last few frames' buffers: a shared-memory file, mapped (``shm``: the decode worker on
the same host maps the same file), or plain memory (``http``). A buffer is reused only after the decode
worker answered for it: a transfer that failed or timed out may still be read on the other side, so
its buffer is dropped (its file unlinked), never rewritten. Files are named after the worker's pid;
files of processes that are gone (a killed worker) are removed when the next worker starts.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

from fleetllm.engine.kv_memory import alive

PREFIX = "fleetllm-kv-"


@dataclass
class Buffer:
    via: str  # "shm" or "http"
    memory: mmap.mmap | bytearray
    path: Path | None = None  # the shared-memory file (shm)

    @property
    def capacity(self) -> int:
        return len(self.memory)


class FrameBuffers:
    """Hands out buffers of at least a frame's size; keeps up to ``keep`` idle ones of at most ``max_bytes``."""

    def __init__(self, shm_dir: Path, keep: int = 2, max_bytes: int = 256 << 20) -> None:
        self.shm_dir, self.keep, self.max_bytes = shm_dir, keep, max_bytes
        self._idle: list[Buffer] = []
        self._files: set[Path] = set()
        self._lock = threading.Lock()
        remove_stale_files(shm_dir)
        weakref.finalize(self, _unlink, self._files)  # at exit too: no file outlives its worker

    def take(self, via: str, size: int) -> Buffer:
        """A buffer for a frame of ``size`` bytes (a kept one when one fits; else new, its pages touched now)."""
        with self._lock:
            for b in sorted(self._idle, key=lambda b: b.capacity):
                if b.via == via and b.capacity >= size:
                    self._idle.remove(b)
                    return b
        if via != "shm":
            return Buffer(via, bytearray(size))
        path = self.shm_dir / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._files.add(path)
        try:
            os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # one call allocates every page
            return Buffer(via, mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE), path)
        finally:
            os.close(fd)

    def give_back(self, b: Buffer, reusable: bool) -> None:
        """``b`` is no longer used here; ``reusable``: nobody else reads it either."""
        with self._lock:
            if reusable and b.capacity <= self.max_bytes:
                self._idle.append(b)
                if len(self._idle) <= self.keep:
                    return
                b = self._idle.pop(0)  # the oldest goes
        if b.path is not None:
            b.path.unlink(missing_ok=True)
            self._files.discard(b.path)


def remove_stale_files(shm_dir: Path) -> None:
    """Remove frame files of processes that no longer run (a prefill worker killed mid-transfer)."""
    for p in shm_dir.glob(PREFIX + "*-*"):
        pid = p.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            p.unlink(missing_ok=True)


def _unlink(paths: set[Path]) -> None:
    for p in list(paths):
        with contextlib.suppress(OSError):
            p.unlink()
