"""Files and batches kept in one local directory, so that a restarted router finds and resumes them.

Layout under ``root`` (directories 0700, files 0600; every JSON document replaced atomically)::

    files/<file id>.json       the file object (and its owner)
    files/<file id>.data       its bytes
    batches/<batch id>.json    the batch object (and its owner)
    batches/<batch id>.done    one JSON line per finished input line, appended and fsynced before the line
                               counts as done: a restarted runner skips exactly these

The directory is created on first use: a router whose Batch API is never called writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OWNER = "owner"  # the key id (or "" with keys off) kept beside each object; never shown to clients


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def open_store(where: str | Path) -> BatchStore:
    """The store at ``where``: a local directory, or ``s3://BUCKET[/PREFIX]``
    (:class:`~fleetllm.router.batches.s3_store.S3BatchStore`)."""
    if str(where).startswith("s3://"):
        from fleetllm.router.batches.s3_store import S3BatchStore

        return S3BatchStore(str(where))
    return BatchStore(where)


class BatchStore:
    """Files and batches under ``root``; each object a dict as the API shows it, plus its owner."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def _dir(self, kind: str) -> Path:
        d = self.root / kind
        if not d.is_dir():
            for p in (self.root, d):
                p.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(p, 0o700)
        return d

    # ---- files ------------------------------------------------------------------------------------------
    def put_file(self, meta: dict[str, Any], data: bytes) -> None:
        _write(self._dir("files") / f"{meta['id']}.data", data)
        self.save("files", meta)

    def file_data(self, file_id: str) -> bytes | None:
        with contextlib.suppress(FileNotFoundError):
            return (self._dir("files") / f"{file_id}.data").read_bytes()
        return None

    def delete_file(self, file_id: str) -> None:
        for suffix in (".data", ".json"):
            (self._dir("files") / f"{file_id}{suffix}").unlink(missing_ok=True)

    # ---- objects (files and batches) --------------------------------------------------------------------
    def save(self, kind: str, obj: dict[str, Any]) -> None:
        _write(self._dir(kind) / f"{obj['id']}.json", json.dumps(obj).encode())

    def load(self, kind: str, obj_id: str) -> dict[str, Any] | None:
        if not obj_id.replace("-", "").replace("_", "").isalnum():  # an id is never a path
            return None
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads((self._dir(kind) / f"{obj_id}.json").read_bytes())
        return None

    def all(self, kind: str) -> list[dict[str, Any]]:
        if not (self.root / kind).is_dir():
            return []
        out = []
        for p in (self.root / kind).glob("*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                out.append(json.loads(p.read_bytes()))
        return out

    def drop_batch(self, batch_id: str) -> None:
        for suffix in (".done", ".json"):
            (self._dir("batches") / f"{batch_id}{suffix}").unlink(missing_ok=True)

    # ---- a batch's finished lines -----------------------------------------------------------------------
    def append_done(self, batch_id: str, index: int, ok: bool, line: dict[str, Any]) -> None:
        """Record input line ``index`` as finished (durably: written and fsynced before this returns)."""
        path = self._dir("batches") / f"{batch_id}.done"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, json.dumps({"i": index, "ok": ok, "line": line}).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)

    def done(self, batch_id: str) -> dict[int, tuple[bool, dict[str, Any]]]:
        """Every finished line of a batch by index; a torn last record (a crash mid-write) is not finished."""
        return {r["i"]: (r["ok"], r["line"]) for r in self._records(batch_id)}

    def _records(self, batch_id: str) -> Iterator[dict[str, Any]]:
        with contextlib.suppress(FileNotFoundError):
            for raw in (self._dir("batches") / f"{batch_id}.done").read_bytes().splitlines():
                with contextlib.suppress(ValueError):
                    yield json.loads(raw)


def _write(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically with ``data`` (0600), durable once this returns."""
    tmp = path.with_name(path.name + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
