"""Files only this user can read: what capture writes locally holds prompts and answers.

Directories are made 0700 and files 0600, whatever the umask. A directory capture writes into must be
owned by this user and writable by nobody else: in a shared one (``/tmp``), another user could plant a
symlink where a spool file will be opened, or read what is written. Files are opened with
``O_NOFOLLOW`` and checked on the descriptor (a regular file, ours, one link), so a symlink or a hard
link planted in the spool never redirects a read or a write.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600


class UnsafePath(OSError):
    """A path capture refuses to use; ``reason`` names why (a metric label)."""

    def __init__(self, path: Path, reason: str, detail: str) -> None:
        super().__init__(f"capture refuses {path}: {detail}")
        self.reason = reason


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory only this user can use: missing parts are made 0700; an existing one must
    be a real directory (no symlink), ours, and not writable by group or others."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:  # made meanwhile: checked below like any existing one
            pass
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raise :class:`UnsafePath` unless ``path`` is a directory of ours that no one else may write."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(path, "symlink", "it is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(path, "not_regular", "it is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePath(path, "foreign_owner", f"it is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o022:
        raise UnsafePath(path, "open_mode", f"it is writable by group or others (mode {st.st_mode & 0o777:o})")


def default_root(name: str) -> Path:
    """A private per-user directory for ``name``: under ``$XDG_RUNTIME_DIR`` when that is ours, else
    ``TMPDIR/NAME-UID``, else ``~/.cache/fleetllm/NAME`` (the first one that is, or can be made, private)."""
    candidates = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        candidates.append(Path(runtime) / "fleetllm" / name)
    candidates += [Path(tempfile.gettempdir()) / f"{name}-{os.geteuid()}", Path.home() / ".cache" / "fleetllm" / name]
    errors = []
    for c in candidates:
        try:
            if c.parent.exists():
                check_parent(c.parent)
            return private_dir(c)
        except OSError as e:
            errors.append(str(e))
    raise UnsafePath(candidates[-1], "no_private_dir", "no private directory: " + "; ".join(errors))


def check_parent(path: Path) -> None:
    """A directory a private one is made in: ours, or one whose sticky bit stops others renaming our entry."""
    st = os.stat(path)
    if st.st_uid != os.geteuid() and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(path, "open_mode", "others may write there and it has no sticky bit")


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (0600, in private directories), never half there: a temporary file renamed."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a temporary file left by a crash keeps its old mode otherwise
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def open_own(path: Path, flags: int) -> int:
    """A descriptor on ``path``, which must be a regular file of ours with one link (else :class:`UnsafePath`)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafePath(path, "symlink", "it is a symlink") from None
        raise e
    st = os.fstat(fd)
    reason = ("not_regular" if not stat.S_ISREG(st.st_mode) else "foreign_owner" if st.st_uid != os.geteuid()
              else "hard_link" if st.st_nlink != 1 else None)
    if reason is not None:
        os.close(fd)
        raise UnsafePath(path, reason, reason.replace("_", " "))
    return fd


def read_own(path: Path) -> bytes:
    """The bytes of ``path`` (see :func:`open_own`)."""
    fd = open_own(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()
