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

The spool directory is private (:mod:`.private`). Anything in it capture did not write the way it
writes (a symlink, a file of another user, a name not its own, a segment that is not JSON lines) is
*rejected*: renamed ``*.rejected``, never shipped, counted by reason; the segments after it ship as usual.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetllm.capture.config import TIERS
from fleetllm.capture.private import FILE_MODE, UnsafePath, open_own, private_dir, read_own

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """A sealed spool file and what its object key is made of."""

    path: Path
    tier: str
    created_ms: int
    uid: str

    @classmethod
    def parse(cls, path: Path) -> Segment:
        """The segment a spool file's name describes; ValueError when it is no name the spool gives."""
        tier, created, uid = path.stem.split("~")
        if not (tier in TIERS and len(uid) == 32 and all(c in "0123456789abcdef" for c in uid)):
            raise ValueError(f"not a spool segment name: {path.name}")
        return cls(path, tier, int(created), uid)


class _Open:
    def __init__(self, directory: Path, tier: str) -> None:
        self.created_ms = int(time.time() * 1000)
        self.path = directory / f"{tier}~{self.created_ms}~{uuid.uuid4().hex}.open"
        # a fresh name, created here: O_EXCL and O_NOFOLLOW refuse anything planted under it
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW, FILE_MODE)
        self.records = 0
        self.opened = time.monotonic()


class Spool:
    """Append records per tier; seal segments; list, and remove once shipped."""

    def __init__(self, directory: str | Path, batch_records: int, max_bytes: int,
                 disk_threshold_percent: float = 75.0, on_reject: Callable[[str], None] | None = None) -> None:
        self.dir = private_dir(directory)
        self.on_reject = on_reject  # called with the reason of every rejected file
        self.batch_records = batch_records
        self.max_bytes = max_bytes
        self.disk_threshold = disk_threshold_percent
        self.full = False  # the disk is past the threshold: capture stops until it is not
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._sealed = False  # a full segment was sealed since the uploader last heard
        self.recovered = self._recover()
        self.bytes = sum(s.path.lstat().st_size for s in self.ready())

    def _recover(self) -> int:
        """Seal what a previous process left open; the number of segments it left."""
        for p in self.dir.glob("*.open"):
            try:
                Segment.parse(p)
                size = _cut_torn_line(p)
            except (ValueError, UnsafePath) as e:
                self.reject(p, getattr(e, "reason", "name"))
                continue
            if size:
                p.rename(p.with_suffix(".ready"))
            else:
                p.unlink()
        return len(self.ready())

    def reject(self, path: Path, reason: str, counted: bool = False) -> None:
        """Set aside a file the spool did not write (or not whole): never shipped, kept for a look.

        ``counted``: a sealed segment whose size :attr:`bytes` holds."""
        if counted:
            with contextlib.suppress(OSError), self._lock:
                self.bytes = max(0, self.bytes - path.lstat().st_size)
        log.warning("capture spool: %s rejected (%s); it is not shipped", path.name, reason.replace("_", " "))
        with contextlib.suppress(OSError):  # a symlink itself is renamed, never its target
            path.rename(path.with_name(path.name + ".rejected"))
        if self.on_reject is not None:
            self.on_reject(reason)

    def read(self, seg: Segment) -> bytes:
        """A sealed segment's records; UnsafePath when it is no segment of ours or not whole JSON lines."""
        data = read_own(seg.path)
        if not data.endswith(b"\n") or any(not _is_record(line) for line in data.splitlines()):
            raise UnsafePath(seg.path, "malformed", "it is not JSON lines")
        return data

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
        """Sealed segments, oldest first (a file whose name is none the spool gives is rejected)."""
        segments = []
        for p in self.dir.glob("*.ready"):
            try:
                segments.append(Segment.parse(p))
            except ValueError:
                self.reject(p, "name")
        return sorted(segments, key=lambda s: (s.created_ms, s.uid))

    def remove(self, seg: Segment) -> None:
        """Forget a segment its sink has confirmed."""
        try:
            size = seg.path.lstat().st_size
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


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _cut_torn_line(path: Path) -> int:
    """Drop a last line a crash left half-written (every whole record ends with a newline); the size kept."""
    fd = open_own(path, os.O_RDWR)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            os.ftruncate(fd, keep)
        return keep
    finally:
        os.close(fd)
