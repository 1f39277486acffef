"""A key's limits held in Redis (``--state-url``), so that every router of a fleet counts against one window.

Per key id (limits are per key, whichever fleet a router serves), under ``fleetllm:rl:<key id>:``:
``req`` a sorted set of the requests admitted (scored by admission time in ms, trimmed to the window),
``tok`` a hash of tokens per second of the window (a second partly in the window counts whole), ``par`` a sorted set of the requests in flight scored by
a lease's expiry (a router that dies mid-request leaks nothing: its leases lapse). One Lua script checks
all three limits and counts the request atomically, on the Redis server's own clock, so routers whose
clocks differ still share one window; the semantics are :class:`~fleetllm.router.keys.KeyLimiter`'s.

Redis never fails a request: when a call fails (or Redis is unreachable) the router falls back to its own
:class:`KeyLimiter` (limits then hold per router, as without a store), sets ``fleetllm:router_state_degraded``
to 1, logs once, and probes Redis in the background every ``probe_s`` until it answers again; from then on
admissions are shared again. Requests are never delayed by the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from fleetllm.router.keys import KeyLimiter, KeyRecord, Refusal
from fleetllm.router.state_url import redact

log = logging.getLogger(__name__)

PREFIX = "fleetllm:rl:"

# KEYS: req, tok, par. ARGV: window ms, rpm, tpm, parallel (-1: no limit), member, lease ms.
# Returns {0, 0} (admitted) or {1|2|3, retry-after ms} for max_parallel_requests | rpm_limit | tpm_limit.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, rpm, tpm, par = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if par >= 0 and redis.call('ZCARD', KEYS[3]) >= par then return {1, 1000} end
if rpm >= 0 and redis.call('ZCARD', KEYS[1]) >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {2, tonumber(oldest[2]) + window - now}
end
if tpm >= 0 then
  local sec, first, sum, oldest = math.floor(now / 1000), math.floor((now - window) / 1000), 0, nil
  local buckets = redis.call('HGETALL', KEYS[2])
  for i = 1, #buckets, 2 do
    local s = tonumber(buckets[i])
    if s < first then  -- the window's first second still counts, whole: a token limit errs on the safe side
      redis.call('HDEL', KEYS[2], buckets[i])
    else
      sum = sum + tonumber(buckets[i + 1])
      if oldest == nil or s < oldest then oldest = s end
    end
  end
  if sum >= tpm then return {3, (oldest + 1) * 1000 + window - now} end
end
redis.call('ZADD', KEYS[1], now, ARGV[5])
redis.call('PEXPIRE', KEYS[1], window)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
return {0, 0}
"""

# KEYS: tok, par. ARGV: member, tokens, window ms.
_DONE = """
redis.call('ZREM', KEYS[2], ARGV[1])
local n = tonumber(ARGV[2])
if n > 0 then
  local t = redis.call('TIME')
  redis.call('HINCRBY', KEYS[1], t[1], n)
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + 1000)
end
return 0
"""

_REASONS = {1: "max_parallel_requests", 2: "rpm_limit", 3: "tpm_limit"}


class SharedLimiter:
    """:class:`KeyLimiter`'s limits in Redis at ``url``, with ``local`` as the fallback while Redis is out."""

    def __init__(self, url: str, registry: CollectorRegistry, local: KeyLimiter | None = None,
                 lease_s: float = 660.0, probe_s: float = 1.0, timeout_s: float = 0.5) -> None:
        self.url = url
        self.local = local or KeyLimiter()
        self.window_ms = int(self.local.window_s * 1000)
        self.lease_ms, self.probe_s = int(lease_s * 1000), probe_s
        # no retries: a failed call falls back at once (the probe is what retries)
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry=Retry(NoBackoff(), 0))
        self._admit = self.client.register_script(_ADMIT)
        self._done = self.client.register_script(_DONE)
        self.gauge = Gauge("fleetllm:router_state_degraded", "1 while the shared state store (--state-url) is "
                           "unreachable and this router limits keys on its own.", registry=registry)
        self.degraded = False
        self._probe: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        # per key id, the tickets of its requests in flight: a Redis member, or None when admitted locally
        self._tickets: dict[str, deque[str | None]] = {}

    async def admit(self, rec: KeyRecord) -> Refusal | None:
        """Check and count one request of ``rec`` (as :meth:`KeyLimiter.admit`)."""
        if self.degraded:
            return self._admit_locally(rec)
        member = uuid.uuid4().hex
        keys = [PREFIX + rec.id + ":req", PREFIX + rec.id + ":tok", PREFIX + rec.id + ":par"]
        args = [self.window_ms, _limit(rec.rpm_limit), _limit(rec.tpm_limit), _limit(rec.max_parallel_requests),
                member, self.lease_ms]
        try:
            code, retry_ms = await self._admit(keys=keys, args=args)
        except Exception as e:  # whatever goes wrong with the store, the request goes on (limited here)
            self._degrade(e)
            return self._admit_locally(rec)
        if code:
            reason = _REASONS[int(code)]
            limit = getattr(rec, reason)
            per = "" if code == 1 else f" per {self.window_ms / 1000:g}s"
            return Refusal(429, f"key {rec.id}: {reason} ({limit}{per}) reached", max(0.0, int(retry_ms) / 1000),
                           reason)
        self._tickets.setdefault(rec.id, deque()).append(member)
        return None

    def done(self, rec: KeyRecord, tokens: int) -> None:
        """A request of ``rec`` ended: free its parallel slot and add its tokens (in the background)."""
        tickets = self._tickets.get(rec.id)
        member = tickets.popleft() if tickets else None
        if member is None:
            self.local.done(rec, tokens)
            return
        task = asyncio.get_running_loop().create_task(self._release(rec, member, tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(self, rec: KeyRecord, member: str, tokens: int) -> None:
        try:
            await self._done(keys=[PREFIX + rec.id + ":tok", PREFIX + rec.id + ":par"],
                             args=[member, tokens, self.window_ms])
        except Exception as e:  # the slot's lease lapses by itself
            self._degrade(e)

    def _admit_locally(self, rec: KeyRecord) -> Refusal | None:
        refusal = self.local.admit(rec)
        if refusal is None:
            self._tickets.setdefault(rec.id, deque()).append(None)
        return refusal

    def _degrade(self, e: BaseException) -> None:
        if not self.degraded:
            log.warning("state store %s unreachable (%s): limiting keys on this router alone until it is back",
                        redact(self.url), type(e).__name__)
            self.degraded = True
            self.gauge.set(1)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._wait_until_back())

    async def _wait_until_back(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            with contextlib.suppress(RedisError, OSError):
                if await self.client.ping():
                    break
        log.warning("state store %s is back: keys' limits are shared again", redact(self.url))
        self.degraded = False
        self.gauge.set(0)

    async def drain(self) -> None:
        """Wait for the releases in flight (each a round trip, or a failure that degrades)."""
        await asyncio.gather(*self._pending, return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        await self.client.aclose()


def _limit(value: int | None) -> int:
    return -1 if value is None else int(value)
