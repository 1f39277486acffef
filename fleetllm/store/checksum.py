"""Checksums as sources publish them: SHA-256 (hub LFS files, S3 checksums), git blob SHA-1 (hub files kept in
git), MD5 (a single-part S3 ETag). A file enters the cache only if its source's checksum matches; the cache's
manifest then records its SHA-256, which every load checks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CHUNK = 8 << 20


@dataclass(frozen=True)
class Checksum:
    """What a source says a file's digest is: ``kind`` (sha256 | git-sha1 | md5) and hex ``value``."""

    kind: str
    value: str


def file_digests(path: Path, kinds: tuple[str, ...] = ("sha256",)) -> dict[str, str]:
    """Hex digests of a file in one read (hashlib releases the GIL: files hash in parallel threads)."""
    size = path.stat().st_size
    hashers = {}
    for kind in kinds:
        if kind == "git-sha1":  # git hashes a header, then the content
            h = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
        else:
            h = hashlib.new(kind)
        hashers[kind] = h
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            for h in hashers.values():
                h.update(chunk)
    return {k: h.hexdigest() for k, h in hashers.items()}


def check(path: Path, expected: Checksum | None) -> str:
    """The file's SHA-256; raise ValueError if it does not match the source's ``expected`` checksum."""
    kinds = ("sha256",) if expected is None or expected.kind == "sha256" else ("sha256", expected.kind)
    digests = file_digests(path, kinds)
    if expected is not None and digests[expected.kind] != expected.value.lower():
        raise ValueError(f"{path.name}: {expected.kind} {digests[expected.kind]} does not match the source's "
                         f"{expected.value}")
    return digests["sha256"]
