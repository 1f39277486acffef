"""The write-ahead spool: captured records on local disk until their upload is confirmed.

One directory per process (router, or one worker). Each tier appends to its open segment
(``TIER~CREATED_MS~UUID.open``) with one ``os.write`` per record: a sequential write into the page
cache, which survives the process's SIGKILL, taken before the response's last byte is sent. A segment
is sealed (renamed ``.ready``) when it holds ``batch_records`` records or has been open for the flush
interval; the uploader ships ready segments and deletes each only after its sink confirmed it.

At start, segments a dead process left open are sealed (a torn last line cut off) and shipped like any
other: nothing a crash interrupted is lost, nothing is shipped twice (a segment's object key derives
from its name). Appends never wait: when the spool is over its size cap, or the disk over its use
threshold, the record is refused and the caller counts it dropped.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Segment:
    """A sealed spool file and what its object key is made of."""

    path: Path
    tier: str
    created_ms: int
    uid: str

    @classmethod
    def parse(cls, path: Path) -> Segment:
        tier, created, uid = path.stem.split("~")
        return cls(path, tier, int(created), uid)


class _Open:
    def __init__(self, directory: Path, tier: str) -> None:
        self.created_ms = int(time.time() * 1000)
        self.path = directory / f"{tier}~{self.created_ms}~{uuid.uuid4().hex}.open"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.records = 0
        self.opened = time.monotonic()


class Spool:
    """Append records per tier; seal segments; list, and remove once shipped."""

    def __init__(self, directory: str | Path, batch_records: int, max_bytes: int,
                 disk_threshold_percent: float = 75.0) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.batch_records = batch_records
        self.max_bytes = max_bytes
        self.disk_threshold = disk_threshold_percent
        self.full = False  # the disk is past the threshold: capture stops until it is not
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._sealed = False  # a full segment was sealed since the uploader last heard
        self.recovered = self._recover()
        self.bytes = sum(p.stat().st_size for p in self.dir.glob("*.ready"))

    def _recover(self) -> int:
        """Seal what a previous process left open; the number of segments it left."""
        for p in self.dir.glob("*.open"):
            _cut_torn_line(p)
            if p.stat().st_size:
                p.rename(p.with_suffix(".ready"))
            else:
                p.unlink()
        return len(list(self.dir.glob("*.ready")))

    def append(self, tier: str, line: bytes) -> bool:
        """Write one record (a JSON line with its newline); False when refused (spool full)."""
        with self._lock:
            if self.full or self.bytes + len(line) > self.max_bytes:
                return False
            seg = self._open.get(tier)
            if seg is None:
                seg = self._open[tier] = _Open(self.dir, tier)
            os.write(seg.fd, line)
            self.bytes += len(line)
            seg.records += 1
            if seg.records >= self.batch_records:
                self._seal(tier)
            return True

    def seal_due(self, interval_s: float) -> None:
        """Seal every open segment older than ``interval_s`` (``0``: all of them)."""
        now = time.monotonic()
        with self._lock:
            for tier in [t for t, s in self._open.items() if now - s.opened >= interval_s]:
                self._seal(tier)

    def _seal(self, tier: str) -> None:
        seg = self._open.pop(tier)
        os.close(seg.fd)
        seg.path.rename(seg.path.with_suffix(".ready"))
        self._sealed = True

    def ready_waiting(self) -> bool:
        """Whether a segment was sealed since the last call (the uploader is woken for it)."""
        sealed, self._sealed = self._sealed, False
        return sealed

    def ready(self) -> list[Segment]:
        """Sealed segments, oldest first."""
        return sorted((Segment.parse(p) for p in self.dir.glob("*.ready")), key=lambda s: (s.created_ms, s.uid))

    def remove(self, seg: Segment) -> None:
        """Forget a segment its sink has confirmed."""
        try:
            size = seg.path.stat().st_size
            seg.path.unlink()
        except FileNotFoundError:  # removed by a concurrent final drain
            return
        with self._lock:
            self.bytes -= size

    def check_disk(self) -> bool:
        """Re-read the disk's use; True when capture is paused for it."""
        usage = shutil.disk_usage(self.dir)
        self.full = usage.used / usage.total * 100.0 > self.disk_threshold
        return self.full

    def expire(self, max_age_s: float) -> int:
        """Delete sealed segments older than ``max_age_s`` (retention); how many went."""
        cutoff = (time.time() - max_age_s) * 1000
        old = [s for s in self.ready() if s.created_ms < cutoff]
        for s in old:
            self.remove(s)
        return len(old)

    @property
    def depth(self) -> int:
        """Segments waiting to be shipped (open ones included)."""
        return len(list(self.dir.glob("*.ready"))) + len(self._open)


def _cut_torn_line(path: Path) -> None:
    """Drop a last line a crash left half-written (every whole record ends with a newline)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
