"""The KV cache's host memory: an anonymous mapping, or a shared-memory file other processes can map.

Both are zero-filled by the kernel on first touch, so a worker pays only for the KV blocks it fills (writing
zeros into a GiB of fresh memory costs seconds of page faults, far more on a VM, before a worker can serve).

A shared pool (:class:`SharedKVFile`, ``/dev/shm/fleetllm-pool-<pid>-<uuid>``) lets a prefill worker on the
same host write a prompt's KV straight into blocks this worker reserved (:mod:`fleetllm.disagg.direct`). The
file is sparse: its pages are allocated as they are first written, by whichever process writes them. It is
made only when the shared-memory filesystem has room for all of it (a tmpfs that fills up kills the process
touching the next page with SIGBUS), is unlinked when the worker stops, and files of processes that no
longer run (a killed worker) are removed when the next one is made.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

POOL_PREFIX = "fleetllm-pool-"
log = logging.getLogger(__name__)


def shm_dir() -> Path:
    """Where shared-memory files go: ``/dev/shm``, else the temporary directory."""
    import tempfile

    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class SharedKVFile:
    """A KV pool in a shared-memory file, mapped read-write; :meth:`close` (or the process's end) unlinks it."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        remove_stale_pools(directory)
        self.path = directory / f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # sparse: no page allocated until written
            self.memory = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, self.path)

    def close(self) -> None:
        """Unlink the file: no other process can map it from now on (the mappings made stay valid)."""
        self._finalizer()


def kv_memory(numel: int, dtype: torch.dtype, device: str,
              shared: Path | None = None) -> tuple[torch.Tensor, SharedKVFile | None]:
    """A zero-filled flat tensor, and its shared-memory file when ``shared`` (a directory) is given and the pool
    can live there (host memory, room on the filesystem)."""
    import torch  # here, not at the top: frame-file code (torch-free) shares this module's file helpers

    if torch.device(device).type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device), None
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    if shared is not None:
        if _room(shared) >= nbytes:
            f = SharedKVFile(shared, nbytes)
            return torch.frombuffer(f.memory, dtype=dtype, count=numel), f
        log.warning("KV pool not shared: %s has less than its %d MiB free", shared, nbytes >> 20)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel), None


def remove_stale_pools(directory: Path) -> None:
    """Remove pool files of processes that no longer run (a decode worker killed)."""
    for p in directory.glob(POOL_PREFIX + "*-*"):
        pid = pool_owner(p)
        if pid is not None and not alive(pid):
            p.unlink(missing_ok=True)


def pool_owner(path: Path) -> int | None:
    """The pid of the worker whose pool ``path`` is (from its name)."""
    pid = path.name.removeprefix(POOL_PREFIX).split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (on this host): a zombie (killed, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def _room(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
