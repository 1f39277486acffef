"""What a source is to the store: it resolves a revision to a commit and a file listing, and downloads files.

Two implementations: :class:`fleetllm.store.hub.HubSource` and :class:`fleetllm.store.s3.S3Source`. A source
raises :class:`~fleetllm.store.errors.SourceUnreachable` when it does not answer (so the cache may serve), and
:class:`~fleetllm.store.errors.StoreError` for answers no cache can fix (no access, no such model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fleetllm.store.checksum import Checksum


@dataclass(frozen=True)
class RemoteFile:
    """One file of a revision: its path in the repo, size, and the source's own checksum (None: none given)."""

    name: str
    size: int
    checksum: Checksum | None


@dataclass(frozen=True)
class Listing:
    """A revision resolved: the commit it stands for and every file of it."""

    commit: str
    files: dict[str, RemoteFile]


class Source(Protocol):
    def resolve(self, revision: str | None) -> Listing:
        """The commit ``revision`` (None: the default branch) stands for now, with its files."""
        ...

    def download(self, commit: str, f: RemoteFile, staging: Path) -> tuple[Path, Checksum | None]:
        """Fetch one file of ``commit`` into ``staging`` (resumable where the source allows); return its path and
        the checksum to check it against (the listing's, or one the source only gives per file)."""
        ...
