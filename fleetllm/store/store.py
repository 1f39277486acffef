"""Fetch a model revision into the node's cache: resolve -> (lock) -> verify what is cached -> download what is
missing or corrupt -> verify against the source's checksums -> manifest.

Fallbacks, in both directions: a cached file that fails its SHA-256 is fetched again from the source; a
source that does not answer (connection refused, timeout, 5xx) is replaced by the cache when it holds a
valid copy of the revision the reference last resolved to, said in the log. A reference pinned to a commit
whose files are cached never contacts the source at all: the commit cannot have changed.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fleetllm.store.cache import Manifest, ModelCache, Revision, unchanged, verified_record
from fleetllm.store.checksum import Checksum
from fleetllm.store.config import StoreConfig
from fleetllm.store.errors import SourceUnreachable, StoreError
from fleetllm.store.phases import Phases
from fleetllm.store.remote import Listing, Source
from fleetllm.store.secret import load_token
from fleetllm.store.selection import needed_files
from fleetllm.store.uri import ModelURI

log = logging.getLogger(__name__)
_COMMIT = re.compile(r"[0-9a-f]{40}")
DEFAULT_REF = "@default"  # the ref name under which a reference without a revision is remembered


@dataclass
class Fetched:
    """A model revision ready in the cache."""

    path: Path  # what the loader reads: the revision's directory, or its one .gguf file
    uri: ModelURI  # pinned to the commit
    phases: dict[str, float]
    offline: bool = False  # served from the cache because the source did not answer
    downloaded: list[str] = field(default_factory=list)  # files fetched (again) from the source
    hold_fd: int | None = None  # keeps the revision marked in use (not evicted) while open: a worker's whole life

    def release(self) -> None:
        """No longer in use by this process (a pull, or a tokenizer already read into memory)."""
        if self.hold_fd is not None:
            os.close(self.hold_fd)
            self.hold_fd = None

    @property
    def revision(self) -> str:
        assert self.uri.revision is not None
        return self.uri.revision


class ModelStore:
    """Remote models into the node-local cache, per :class:`StoreConfig`."""

    def __init__(self, cfg: StoreConfig | None = None) -> None:
        self.cfg = cfg or StoreConfig()
        self.cache = ModelCache(self.cfg.root())

    def source(self, uri: ModelURI) -> Source:
        if uri.scheme == "hf":
            from fleetllm.store.hub import HubSource

            return HubSource(uri, self.cfg.endpoint(), load_token(self.cfg, str(uri)))
        from fleetllm.store.s3 import S3Source

        return S3Source(uri, self.cfg.s3_endpoint_url)

    def pin(self, ref: str) -> ModelURI:
        """``ref`` pinned to the commit it resolves to now (or, with the source down, last resolved to here)."""
        uri = ModelURI.parse(ref)
        return uri.at(self._resolve(uri)[1])

    def fetch(self, ref: str, weights: bool = True, adapter: bool = False) -> Fetched:
        """``ref`` (hf:// or s3://) in the cache, verified; ``weights=False`` for config and tokenizer only;
        ``adapter=True`` for a LoRA adapter's files (pinned, checked and cached as a model's are)."""
        uri, phases = ModelURI.parse(ref), Phases()
        with phases.timed("resolve"):
            listing, commit, offline = self._resolve(uri)
        rev = self.cache.revision(uri.key, commit)
        with rev.download_lock():
            m = rev.manifest() or Manifest(str(uri.at(commit)), commit)
            if listing is not None and weights:
                m.wanted = needed_files(listing.files, str(uri), uri.file, adapter=adapter)
            names = list(listing.files) if listing is not None else (m.wanted or list(m.files))
            wanted = needed_files(names, str(uri), uri.file, weights, adapter)
            with phases.timed("verify"):
                bad = self._check_cached(rev, m, wanted)
            missing = [n for n in wanted if n not in m.files]
            if missing:
                listing = listing or self._listing_for_refetch(uri, commit, missing)
                downloaded = self._download(uri, listing, missing, rev, m, phases)
                rev.write_manifest(m)
            else:
                downloaded = []
        if not offline and not (uri.revision and _COMMIT.fullmatch(uri.revision)):
            self.cache.remember(uri.key, uri.revision or DEFAULT_REF, commit)
        rev.touch()
        fetched = Fetched(_model_path(rev, wanted), uri.at(commit), phases.seconds, offline, downloaded, rev.hold())
        if bad:
            log.warning("model %s: cached %s failed verification and was fetched again", uri, ", ".join(bad))
        if self.cfg.cache_max_gb is not None:
            for gone in self.cache.evict(int(self.cfg.cache_max_gb * 2**30), keep=rev):
                log.info("model cache over %.1f GB: evicted %s", self.cfg.cache_max_gb, gone.uri)
        return fetched

    def _resolve(self, uri: ModelURI) -> tuple[Listing | None, str, bool]:
        """(listing or None when the source was not asked, commit, offline)."""
        if uri.revision and self._cached(uri, uri.revision):
            return None, uri.revision, False  # a cached pinned revision cannot have changed: no network
        if not self.cfg.offline:
            try:
                listing = self.source(uri).resolve(uri.revision)
                return listing, listing.commit, False
            except SourceUnreachable as e:
                reason = str(e)
        else:
            reason = "offline mode"
        commit = self.cache.recall(uri.key, uri.revision or DEFAULT_REF) or uri.revision
        if commit is None or not self._cached(uri, commit):
            raise StoreError(f"model {uri}: {reason}, and this node has no {self._incomplete(uri, commit)}", 503)
        log.warning("model %s: %s; serving revision %s from the local cache (offline)", uri, reason, commit)
        return None, commit, True

    def _incomplete(self, uri: ModelURI, commit: str | None) -> str:
        """What the cache lacks to serve ``commit`` offline: a copy, or the files verify set aside (named)."""
        m = self.cache.revision(uri.key, commit).manifest() if commit else None
        if m is None or not m.quarantined:
            return "cached copy of it"
        return (f"complete cached copy: `fleetllm models verify` set {', '.join(sorted(m.quarantined))} aside (its "
                f"bytes no longer matched the manifest); `fleetllm models verify --repair` fetches it again once "
                f"the source answers")

    def repair(self, uri_text: str, commit: str) -> list[str]:
        """Fetch again, now, the files ``fleetllm models verify`` set aside from a cached revision; their names."""
        uri = ModelURI.parse(uri_text)
        rev = self.cache.revision(uri.key, commit)
        with rev.download_lock():
            m = rev.manifest()
            names = sorted(n for n in (m.quarantined if m else {}) if n not in m.files)
            if not names:
                return []
            if self.cfg.offline:
                raise StoreError(f"model {uri}: offline mode: cannot fetch {', '.join(names)} again", 503)
            listing = self._listing_for_refetch(uri, commit, names)
            self._download(uri, listing, names, rev, m, Phases())
            rev.write_manifest(m)
        return names

    def _cached(self, uri: ModelURI, commit: str) -> bool:
        m = self.cache.revision(uri.key, commit).manifest()
        return m is not None and bool(m.wanted) and all(n in m.files for n in m.wanted)

    def _listing_for_refetch(self, uri: ModelURI, commit: str, missing: list[str]) -> Listing:
        """The source's listing of ``commit`` when cached files must be fetched again."""
        try:
            return self.source(uri).resolve(commit)
        except SourceUnreachable as e:
            raise StoreError(f"model {uri}: cached {', '.join(missing)} missing or corrupt and the source is "
                             f"unreachable ({e})", 503) from None

    def _check_cached(self, rev: Revision, m: Manifest, wanted: list[str]) -> list[str]:
        """Drop from the manifest every wanted file that is gone or whose SHA-256 changed; return their names.

        A file that is still the one its entry was verified from (same inode, size, mtime) is not hashed again:
        anything that writes to it changes its mtime. ``fleetllm models verify`` hashes every file regardless.
        A file hashed here that matches gets a fresh entry, so it is trusted on the next start.
        """
        present = [n for n in wanted if n in m.files]

        def check_one(name: str) -> dict | None:
            path, record = rev.files / name, m.files[name]
            try:
                if unchanged(path, record):
                    return record
                if path.stat().st_size != record["size"]:
                    return None
                return verified_record(path, Checksum("sha256", record["sha256"]))
            except (OSError, ValueError):
                return None

        with ThreadPoolExecutor(max(1, min(len(present), os.cpu_count() or 1))) as pool:
            checked = dict(zip(present, pool.map(check_one, present), strict=True))
        bad = [n for n, record in checked.items() if record is None]
        refreshed = [n for n, record in checked.items() if record is not None and record is not m.files[n]]
        for n in bad:
            del m.files[n]
        for n in refreshed:
            m.files[n] = checked[n]
        if refreshed:
            rev.write_manifest(m)
        return bad

    def _download(self, uri: ModelURI, listing: Listing, names: list[str], rev: Revision, m: Manifest,
                  phases: Phases) -> list[str]:
        """Fetch ``names`` in parallel, check each against the source's checksum, move it into the cache."""
        source = self.source(uri)
        rev.staging.mkdir(parents=True, exist_ok=True)
        with phases.timed("download"), ThreadPoolExecutor(self.cfg.download_workers) as pool:
            got = list(pool.map(lambda n: source.download(listing.commit, listing.files[n], rev.staging), names))

        def verify(item: tuple[str, tuple[Path, Checksum | None]]) -> dict:
            name, (path, checksum) = item
            try:
                return verified_record(path, checksum)  # a rename keeps what it records
            except ValueError as e:
                path.unlink(missing_ok=True)  # a bad download is not resumed from
                raise StoreError(f"model {uri}: downloaded file failed verification: {e}", 502) from None

        with phases.timed("verify"), ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            records = list(pool.map(verify, zip(names, got, strict=True)))
        for name, (path, _), record in zip(names, got, records, strict=True):
            rev.place(path, name)
            m.files[name] = record
            m.quarantined.pop(name, None)
        return names


def _model_path(rev: Revision, wanted: list[str]) -> Path:
    """The revision's directory, or its .gguf file when that is the model."""
    if len(wanted) == 1 and wanted[0].endswith(".gguf"):
        return rev.files / wanted[0]
    return rev.files
