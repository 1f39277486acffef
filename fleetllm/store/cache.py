"""The node-local model cache (the NVMe tier): one directory per model revision, with a manifest.

Layout under the cache root::

    <repo key>/refs/<revision>           the commit a branch or tag last resolved to (for offline starts)
    <repo key>/<commit>/files/...        the model directory the loader reads (memory-mapped in place)
    <repo key>/<commit>/manifest.json    the revision's files: size and SHA-256 of each, as verified
    <repo key>/<commit>/quarantine/...   files `fleetllm models verify` found changed: out of ``files/`` and of the
                                         manifest (so never served), kept to look at until fetched again
    <repo key>/<commit>/.staging/        downloads in progress (resumed by the next pull)
    <repo key>/<commit>.lock             held while a process downloads this revision: one download per node
    <repo key>/<commit>.inuse            held shared by every process serving it: eviction skips it
    <repo key>/<commit>/last_used        its mtime orders the LRU eviction

Invariants: a file is in ``files/`` only after its source's checksum matched, and in the manifest only with
the SHA-256 it had then; every write is a temp file, fsync, rename, so a crash leaves the old state or the
new one, never half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote

from fleetllm.store.checksum import Checksum, check


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader sees the old content or the new one, even after a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Manifest:
    """A cached revision: where it came from, the files its source listed, and those verified on disk."""

    uri: str  # the pinned reference, e.g. hf://org/name@<commit>
    commit: str
    wanted: list[str] = field(default_factory=list)  # the files a full model needs (what offline starts check)
    # name -> {"size", "sha256", "mtime_ns", "ino"}: the SHA-256 verified, and the file's identity when it was
    files: dict[str, dict] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    quarantined: dict[str, str] = field(default_factory=dict)  # name -> why verify set it aside (until fetched again)

    def size(self) -> int:
        return sum(f["size"] for f in self.files.values())


def verified_record(path: Path, expected: Checksum | None) -> dict:
    """``path`` hashed against ``expected`` (ValueError if it does not match, or if the file changed while it
    was hashed); its manifest entry: the SHA-256 and the file's identity (inode, size, mtime).

    The file's mtime is set a second into the past, a time no later write can give it: a file written again in
    the clock tick it was verified in would otherwise keep its recorded mtime (git's "racy" files).
    """
    before = path.stat()
    sha256 = check(path, expected)
    if not _same(path.stat(), before.st_size, before.st_mtime_ns, before.st_ino):
        raise ValueError(f"{path.name} changed while it was verified")
    os.utime(path, ns=(before.st_atime_ns, time.time_ns() - 1_000_000_000))
    st = path.stat()
    return {"size": st.st_size, "sha256": sha256, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def unchanged(path: Path, record: dict) -> bool:
    """``path`` is still the file ``record`` was made from: same inode, size and mtime. Anything that rewrites
    it, in place or by replacing it, changes one of them; only ``fleetllm models verify`` finds a file whose
    bytes changed under the filesystem (media errors)."""
    return _same(path.stat(), record["size"], record.get("mtime_ns"), record.get("ino"))


def _same(st: os.stat_result, size: int, mtime_ns: int | None, ino: int | None) -> bool:
    return (st.st_size, st.st_mtime_ns, st.st_ino) == (size, mtime_ns, ino)


class Revision:
    """One model revision's directory in the cache."""

    def __init__(self, repo_dir: Path, commit: str) -> None:
        self.commit = commit
        self.dir = repo_dir / commit
        self.files = self.dir / "files"
        self.staging = self.dir / ".staging"
        self._lock_path = repo_dir / f"{commit}.lock"
        self._inuse_path = repo_dir / f"{commit}.inuse"

    def manifest(self) -> Manifest | None:
        try:
            return Manifest(**json.loads((self.dir / "manifest.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def write_manifest(self, m: Manifest) -> None:
        write_atomic(self.dir / "manifest.json", json.dumps(asdict(m), indent=1).encode())

    def place(self, downloaded: Path, name: str) -> None:
        """Move a verified download into ``files/`` (fsynced, renamed: never seen half-written)."""
        target = self.files / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(downloaded, "rb") as f:
            os.fsync(f.fileno())
        os.replace(downloaded, target)
        fsync_dir(target.parent)
        (self.dir / "quarantine" / name).unlink(missing_ok=True)  # the damaged copy it replaces

    def quarantine(self, damaged: dict[str, tuple[dict, str]]) -> list[str]:
        """Set aside files whose bytes no longer match their manifest entry (``name -> (entry, why)``, as
        ``fleetllm models verify`` hashed them): each leaves ``files/`` and the manifest, so no start serves it;
        the next fetch gets it again from the source. Under the download lock; a file a fetch replaced since it
        was hashed (its entry changed) is left alone. Returns the names set aside."""
        with self.download_lock():
            m = self.manifest()
            names = [n for n, (entry, _) in damaged.items() if m is not None and m.files.get(n) == entry]
            for name in names:
                aside = self.dir / "quarantine" / name
                aside.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileNotFoundError):  # a file gone is set aside already
                    os.replace(self.files / name, aside)
                del m.files[name]
                m.quarantined[name] = damaged[name][1]
            if names:
                self.write_manifest(m)
        return names

    @contextlib.contextmanager
    def download_lock(self) -> Iterator[None]:
        """Exclusive across processes of this node (flock): the second puller waits, then finds it cached."""
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def hold(self) -> int:
        """Mark the revision in use for as long as the returned descriptor stays open (a shared flock)."""
        fd = os.open(self._inuse_path, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def unused(self) -> bool:
        """No process holds it (checked with a non-blocking exclusive flock)."""
        try:
            fd = os.open(self._inuse_path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    def touch(self) -> None:
        (self.dir / "last_used").touch()

    def last_used(self) -> float:
        try:
            return (self.dir / "last_used").stat().st_mtime
        except OSError:
            return 0.0

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        for p in (self._lock_path, self._inuse_path):
            p.unlink(missing_ok=True)


class ModelCache:
    """Every cached revision under one root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def revision(self, key: str, commit: str) -> Revision:
        return Revision(self.root / key, commit)

    def remember(self, key: str, revision: str, commit: str) -> None:
        """Record what ``revision`` (a branch or tag) resolved to, for a start while the source is down."""
        write_atomic(self.root / key / "refs" / quote(revision, safe=""), commit.encode())

    def recall(self, key: str, revision: str) -> str | None:
        """The commit ``revision`` last resolved to on this node, or None."""
        try:
            return (self.root / key / "refs" / quote(revision, safe="")).read_text().strip() or None
        except OSError:
            return None

    def revisions(self) -> list[tuple[Revision, Manifest]]:
        """Every revision with a manifest, least recently used first."""
        out = []
        for manifest_path in self.root.glob("*/*/manifest.json"):
            rev = Revision(manifest_path.parent.parent, manifest_path.parent.name)
            m = rev.manifest()
            if m is not None:
                out.append((rev, m))
        return sorted(out, key=lambda rm: rm[0].last_used())

    def evict(self, limit_bytes: int, keep: Revision | None = None) -> list[Manifest]:
        """Remove least recently used revisions that no process holds until the cache fits ``limit_bytes``."""
        entries = self.revisions()
        total = sum(m.size() for _, m in entries)
        evicted = []
        for rev, m in entries:
            if total <= limit_bytes:
                break
            if keep is not None and rev.dir == keep.dir or not rev.unused():
                continue
            rev.remove()
            total -= m.size()
            evicted.append(m)
        return evicted
