"""A shared Redis server as a KV tier's store (``--kv-remote redis://HOST:PORT``).

Keys are ``fleetllm:kv:<namespace>:<hash>``, the block-hash chain every worker computes alike, so a block
one worker wrote is a hit for any other of the same model and layout; a value is one stored block
(:mod:`fleetllm.kvtier.codec`, checksummed). Writing one key twice writes the same bytes (idempotent). The
server evicts by its own LRU (``maxmemory-policy allkeys-lru``).

A slow or absent server is never waited for past ``timeout_s``: a call that fails raises, and for
``backoff_s`` after it the store answers "nothing" at once (:class:`Unavailable`) instead of trying again on
every request. A password never reaches a log line (:func:`fleetllm.router.state_url.redact`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fleetllm.router.state_url import AUTO, StateURLError, redact, state_url_value

PREFIX = "fleetllm:kv:"
MGET_BLOCKS = 16  # blocks asked per round trip (the deadline is per reply)


class Unavailable(ConnectionError):
    """The server failed a moment ago: not asked again until its back-off ends."""


def kv_remote_value(text: str) -> str:
    """``--kv-remote``: a redis:// or rediss:// URL with a host, or ``auto`` (``fleetllm serve`` and the fleet
    YAML only: the fleet's private redis-server); a ValueError, password redacted, otherwise."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return state_url_value(text)
    except StateURLError:
        raise StateURLError(f"--kv-remote is redis://[:PASSWORD@]HOST:PORT, rediss://... or (fleetllm serve) auto, "
                            f"not {redact(text)!r}") from None


def no_auto(url: str | None) -> None:
    """Refuse ``auto`` where no fleet starts a Redis (a worker, ``LLM``): a ValueError naming the way out."""
    if url == AUTO:
        raise ValueError("--kv-remote auto starts a redis-server with `fleetllm serve` (or a fleet YAML's "
                         "engine: {kv_remote: auto}); give a worker the redis://HOST:PORT of a Redis")

class RedisStore:
    """Blocks under ``fleetllm:kv:<namespace>:`` in the Redis server at ``url``."""

    def __init__(self, url: str, namespace: str, timeout_s: float = 0.2, backoff_s: float = 2.0,
                 on_health: Callable[[bool], None] | None = None) -> None:
        """``on_health``: told False when a call fails after one succeeded (or none ran yet), True when one
        succeeds after a failure (from either thread)."""
        import redis

        self.url = redact(url)  # for logs
        self.prefix = f"{PREFIX}{namespace}:"
        self.backoff_s = backoff_s
        self._down_until = 0.0
        self._ok: bool | None = None  # the last call's outcome (None: no call yet)
        self.on_health = on_health
        self._lock = threading.Lock()  # the back-off clock, set by either thread
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    def get_many(self, hashes: list[int]) -> list[bytes | None]:
        """The bytes under each of ``hashes`` up to the first absent one (None), :data:`MGET_BLOCKS` per round
        trip: one reply of a long prompt's blocks (a 4k-token prompt of a small model is ~190 MB) would outlast
        the deadline on a busy host. A call that fails after some succeeded returns what they found (the
        back-off starts); a first call that fails raises."""
        out: list[bytes | None] = []
        for i in range(0, len(hashes), MGET_BLOCKS):
            keys = [self.key(h) for h in hashes[i : i + MGET_BLOCKS]]
            try:
                values = self._call(lambda keys=keys: self.client.mget(keys))
            except Exception:
                if not out:
                    raise
                return out
            for v in values:
                out.append(v)
                if v is None:
                    return out
        return out

    def put(self, block_hash: int, data: bytes) -> None:
        self._call(lambda: self.client.set(self.key(block_hash), data))

    def close(self) -> None:
        self.client.close()

    def _call(self, fn):  # noqa: ANN001, ANN202 - a redis call, whatever it returns
        if time.monotonic() < self._down_until:
            raise Unavailable(f"{self.url}: backing off after an error")
        try:
            result = fn()
        except Exception:
            with self._lock:
                self._down_until = time.monotonic() + self.backoff_s
            self._health(False)
            raise
        self._health(True)
        return result

    def _health(self, ok: bool) -> None:
        if ok != self._ok:
            self._ok = ok
            if self.on_health is not None:
                self.on_health(ok)
