"""API keys: who may call the fleet, which models, and how much (LiteLLM's virtual-key limits).

A key is ``flk-`` + 43 random URL-safe characters; only its SHA-256 is stored (a key has 256 bits of entropy,
so a fast hash is safe: there is nothing to brute-force). Its public id (``key-`` + the first 12 hex digits
of the hash) is what logs, metrics and capture name; the key itself is shown once, at creation.

The store is one YAML file (``fleetllm keys create|ls|revoke`` edit it, the router reads it); the router
re-reads it when its modification time changes, so a revoked key is refused from the next request on.
Limits per key, each over a sliding window (60 s by default, injectable for tests):
``rpm_limit`` requests, ``tpm_limit`` prompt + output tokens, and ``max_parallel_requests`` at once.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from fleetllm.errors import UsageError, one_line, unknown_key, yaml_error

PREFIX = "flk-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key_hash: str) -> str:
    return "key-" + key_hash[:12]


@dataclass
class KeyRecord:
    """One key as stored: its hash, never the key."""

    hash: str
    name: str = ""
    models: list[str] = field(default_factory=list)  # empty: every model
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    max_parallel_requests: int | None = None
    # the most urgent `priority` its requests may ask for: a request asking for a more urgent one (a smaller
    # number, the default 0 included) is served at this one instead (None: any priority)
    priority_floor: int | None = None
    weight: float = 1.0  # its share of a saturated fleet against other keys of its priority band (--flow-control)
    admin: bool = False  # may read /metrics, /router/state and the admin endpoints
    created: float = 0.0
    revoked: bool = False

    @property
    def id(self) -> str:
        return key_id(self.hash)

    def allows(self, model: str | None) -> bool:
        return not self.models or model in self.models

    def public(self) -> dict[str, Any]:
        """What ``keys ls`` and the usage endpoint show: everything but the hash."""
        d = asdict(self)
        d.pop("hash")
        return {"id": self.id, **d}


class KeyStore:
    """The keys of one YAML file (``keys: [...]``), re-read whenever the file changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mtime: float | None = None
        self._by_hash: dict[str, KeyRecord] = {}
        self._lock = threading.Lock()
        self.reload()

    def reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            self._by_hash, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        records = _read_records(self.path)
        self._by_hash, self._mtime = {r.hash: r for r in records}, mtime

    def records(self) -> list[KeyRecord]:
        self.reload()
        return list(self._by_hash.values())

    def authenticate(self, key: str | None) -> KeyRecord | None:
        """The live record of ``key``, or None (unknown, revoked or absent)."""
        if not key:
            return None
        self.reload()
        rec = self._by_hash.get(hash_key(key))
        return rec if rec is not None and not rec.revoked else None

    def create(self, name: str = "", **limits: Any) -> tuple[KeyRecord, str]:
        """A new key: returns its record and the key itself (shown once, stored nowhere)."""
        key = PREFIX + secrets.token_urlsafe(32)
        rec = KeyRecord(hash_key(key), name=name, created=time.time(), **limits)
        with self._lock:
            self.reload()
            self._by_hash[rec.hash] = rec
            self._write()
        return rec, key

    def revoke(self, ident: str) -> KeyRecord:
        """Revoke a key by its id or name; raises KeyError if none matches."""
        with self._lock:
            self.reload()
            for rec in self._by_hash.values():
                if ident in (rec.id, rec.name) and not rec.revoked:
                    rec.revoked = True
                    self._write()
                    return rec
        raise KeyError(f"no live key with id or name {ident!r}")

    def _write(self) -> None:
        """Atomically: a reader never sees half a file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # hashes only, but nobody else's business
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump({"keys": [asdict(r) for r in self._by_hash.values()]}, f, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._mtime = self.path.stat().st_mtime_ns


@dataclass
class Refusal:
    """Why a request may not go now: HTTP status, message, and for 429 the seconds until it may."""

    status: int
    message: str
    retry_after: float | None = None
    reason: str = ""  # the limit that refused it: rpm_limit, tpm_limit or max_parallel_requests


class KeyLimiter:
    """Per-key sliding windows of requests and tokens, and in-flight counts.

    ``admit`` checks and counts a request; ``done`` releases its parallel slot and adds its tokens.
    Tokens are known only when a response ends, so a request that starts under ``tpm_limit`` may take the
    key past it: the limit then holds the next requests back until the window has room again.
    """

    def __init__(self, window_s: float = 60.0, clock: Any = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._requests: dict[str, deque[float]] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}
        self._parallel: dict[str, int] = {}

    def admit(self, rec: KeyRecord) -> Refusal | None:
        now = self.clock()
        reqs = self._requests.setdefault(rec.id, deque())
        toks = self._tokens.setdefault(rec.id, deque())
        while reqs and reqs[0] <= now - self.window_s:  # what left the window no longer counts
            reqs.popleft()
        while toks and toks[0][0] <= now - self.window_s:
            toks.popleft()
        if rec.max_parallel_requests is not None and self._parallel.get(rec.id, 0) >= rec.max_parallel_requests:
            return Refusal(429, f"key {rec.id}: max_parallel_requests ({rec.max_parallel_requests}) reached", 1.0,
                           "max_parallel_requests")
        if rec.rpm_limit is not None and len(reqs) >= rec.rpm_limit:
            return Refusal(429, f"key {rec.id}: rpm_limit ({rec.rpm_limit} per {self.window_s:g}s) reached",
                           reqs[0] + self.window_s - now, "rpm_limit")
        if rec.tpm_limit is not None and sum(n for _, n in toks) >= rec.tpm_limit:
            return Refusal(429, f"key {rec.id}: tpm_limit ({rec.tpm_limit} per {self.window_s:g}s) reached",
                           toks[0][0] + self.window_s - now, "tpm_limit")
        reqs.append(now)
        self._parallel[rec.id] = self._parallel.get(rec.id, 0) + 1
        return None

    def done(self, rec: KeyRecord, tokens: int) -> None:
        self._parallel[rec.id] = max(0, self._parallel.get(rec.id, 0) - 1)
        if tokens:
            self._tokens.setdefault(rec.id, deque()).append((self.clock(), tokens))


def _read_records(path: Path) -> list[KeyRecord]:
    """The records of a keys file; a file that is not one is refused naming it (UsageError, one line)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise yaml_error(path, e) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"keys file {str(path)!r} cannot be read: {one_line(str(e))}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(r, dict) for r in entries):
        raise UsageError(f"keys file {str(path)!r} is not a keys file (`keys:` a list of records, as "
                         f"`fleetllm keys create --file` writes it)")
    known = {f.name for f in fields(KeyRecord)}
    for i, r in enumerate(entries):
        for key in r:
            if key not in known:
                raise UsageError(f"keys file {str(path)!r}: {unknown_key(f'keys[{i}].{key}', known)}")
    records = [KeyRecord(**r) for r in entries]
    for i, r in enumerate(records):
        if isinstance(r.weight, bool) or not isinstance(r.weight, int | float) or not 0 < r.weight < float("inf"):
            raise UsageError(f"keys file {str(path)!r}: keys[{i}].weight must be a positive number")
    return records
