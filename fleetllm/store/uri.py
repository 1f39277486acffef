"""Model references: a local path or alias, ``hf://org/name[/file.gguf][@revision]``, ``s3://bucket/prefix[@revision]``.

A remote reference names a repository (or prefix) and optionally one file in it (a ``.gguf`` out of a repo
of many quantisations) and a revision: a branch, tag or commit for the hub; for S3 the store's own
revision (a hash of the objects' ETags), which pins a prefix the way a commit pins a repo.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fleetllm.errors import UsageError

SCHEMES = ("hf", "s3")
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def is_remote(ref: str) -> bool:
    """Whether ``ref`` is a store URI rather than a local path or alias."""
    return ref.split("://", 1)[0] in SCHEMES and "://" in ref


@dataclass(frozen=True)
class ModelURI:
    """A parsed remote model reference."""

    scheme: str  # "hf" | "s3"
    repo: str  # hf: "org/name"; s3: "bucket/prefix"
    file: str | None = None  # one file of the repo (a .gguf), or None for the loader's usual set
    revision: str | None = None  # as asked: a branch, tag or commit (hf), a store revision (s3); None: latest

    @classmethod
    def parse(cls, ref: str) -> ModelURI:
        """``hf://org/name[/file.gguf][@rev]`` or ``s3://bucket/prefix[/file.gguf][@rev]``; a UsageError (a
        ValueError) otherwise."""
        scheme, sep, rest = ref.partition("://")
        if not sep or scheme not in SCHEMES:
            raise UsageError(f"{ref!r}: not a store URI (hf://org/name[@revision] or s3://bucket/prefix)")
        rest, _, revision = rest.partition("@")
        parts = [p for p in rest.strip("/").split("/") if p]
        file = parts.pop() if parts and parts[-1].endswith(".gguf") else None
        if scheme == "hf" and len(parts) != 2:
            raise UsageError(f"{ref!r}: a hub model is hf://org/name[/file.gguf][@revision]")
        if scheme == "s3" and not parts:
            raise UsageError(f"{ref!r}: an S3 model is s3://bucket/prefix")
        return cls(scheme, "/".join(parts), file, revision or None)

    @property
    def bucket(self) -> str:
        return self.repo.split("/", 1)[0]

    @property
    def prefix(self) -> str:
        """The S3 key prefix of the model's objects ("" for a whole bucket), without a trailing slash."""
        return self.repo.partition("/")[2]

    @property
    def key(self) -> str:
        """A directory name for this repository in the cache (the revision and file are not part of it)."""
        return f"{self.scheme}--" + "--".join(_SAFE.sub("_", p) for p in self.repo.split("/"))

    def at(self, revision: str) -> ModelURI:
        """The same reference pinned to ``revision`` (a commit)."""
        return ModelURI(self.scheme, self.repo, self.file, revision)

    def __str__(self) -> str:
        path = f"{self.repo}/{self.file}" if self.file else self.repo
        return f"{self.scheme}://{path}" + (f"@{self.revision}" if self.revision else "")
