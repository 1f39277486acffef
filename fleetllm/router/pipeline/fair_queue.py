"""The admission stage's queue: priority bands, and within a band weighted fair queuing between tenants.

Pure bookkeeping (no clock of its own, no asyncio): :class:`~fleetllm.router.pipeline.admission.FlowControl`
drives it.

- **Bands.** A request's band is its priority's (:func:`fleetllm.router.tenancy.band`): ``high`` (< 0),
  ``normal`` (0), ``low`` (> 0; batch lines). The highest band with a request waiting goes first, except that a
  band's oldest request climbs one band per ``aging_s`` seconds waited, so a low band is never starved for good
  (of two bands level after climbing, the one whose oldest request came first goes first).
- **Tenants within a band.** Weighted fair queuing by virtual finish tags: a request of a tenant with weight
  ``w`` is tagged ``max(V, the tenant's last tag) + 1/w``, where ``V`` is the band's virtual time (the tag of
  the last request it released); the smallest tag goes first, arrival order among equal tags. A tenant that sent
  nothing for a while starts at ``V``: it gets its share from now on, not a burst of saved-up credit. Each request
  costs one unit (fairness in requests: a request's tokens are unknown until it ends).
- **Shedding.** The queue holds at most ``limit`` requests. A request arriving at a full queue pushes out the
  newest request of the lowest band below its own, if there is one; otherwise it is itself refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BANDS = ("high", "normal", "low")  # release order, most urgent first


@dataclass(eq=False)
class Entry:
    """One queued request."""

    tenant: str
    band: int  # index into BANDS
    arrived: float
    seq: int = 0
    tag: float = 0.0
    payload: Any = None  # what the owner needs back (FlowControl: the waiter)


@dataclass
class _Band:
    tenants: dict[str, deque[Entry]] = field(default_factory=dict)
    last_tag: dict[str, float] = field(default_factory=dict)
    vtime: float = 0.0
    size: int = 0


class FairQueue:
    """Bands of per-tenant FIFO queues, released by weighted fair queuing (see the module's docstring)."""

    def __init__(self, limit: int, aging_s: float) -> None:
        self.limit = limit
        self.aging_s = aging_s
        self.bands = [_Band() for _ in BANDS]
        self._seq = 0

    def __len__(self) -> int:
        return sum(b.size for b in self.bands)

    def push(self, e: Entry, weight: float) -> Entry | None:
        """Queue ``e``; the entry shed to make room (``e`` itself when nothing below its band can go)."""
        shed = None
        if len(self) >= self.limit:
            shed = self._newest_below(e.band)
            if shed is None:
                return e
            self.remove(shed)
        b = self.bands[e.band]
        self._seq += 1
        e.seq = self._seq
        e.tag = max(b.vtime, b.last_tag.get(e.tenant, 0.0)) + 1.0 / max(weight, 1e-6)
        b.last_tag[e.tenant] = e.tag
        b.tenants.setdefault(e.tenant, deque()).append(e)
        b.size += 1
        return shed

    def peek(self, now: float) -> Entry | None:
        """The request :meth:`pop` would release now (None when empty), left queued."""
        head = self._head(now)
        return head[1][0] if head is not None else None

    def pop(self, now: float) -> Entry | None:
        """The next request to release (None when empty)."""
        e = self.peek(now)
        if e is not None:
            self.take(e)
        return e

    def take(self, e: Entry) -> None:
        """Release ``e`` (queued), whether or not it was next: the band's virtual time moves on to its tag."""
        self.remove(e)
        b = self.bands[e.band]
        b.vtime = max(b.vtime, e.tag)

    def waiting(self, tenant: str) -> bool:
        """Whether ``tenant`` has a request queued in any band."""
        return any(tenant in b.tenants for b in self.bands)

    def first(self, ok: Callable[[Entry], bool], below: int) -> Entry | None:
        """The first tenant's head, by band then tag, that ``ok`` accepts, in the bands above index ``below``."""
        heads = [q[0] for b in self.bands[:below] for q in b.tenants.values() if ok(q[0])]
        return min(heads, key=lambda e: (e.band, e.tag, e.seq), default=None)

    def _head(self, now: float) -> tuple[_Band, deque[Entry]] | None:
        """The band that goes next and, in it, the tenant queue whose head has the smallest tag."""
        heads = [(i, min(q[0].arrived for q in b.tenants.values())) for i, b in enumerate(self.bands) if b.size]
        if not heads:
            return None
        # a band's rank improves by one per aging_s its oldest request waited; level bands: the older goes first
        i = min(heads, key=lambda h: (h[0] - int((now - h[1]) / self.aging_s) if self.aging_s > 0 else h[0], h[1]))[0]
        b = self.bands[i]
        return b, min(b.tenants.values(), key=lambda q: (q[0].tag, q[0].seq))

    def remove(self, e: Entry) -> bool:
        """Take ``e`` out (its deadline passed, its client left); False if it was not queued."""
        b = self.bands[e.band]
        q = b.tenants.get(e.tenant)
        if q is None or e not in q:
            return False
        q.remove(e)
        if not q:
            del b.tenants[e.tenant]
        b.size -= 1
        return True

    def _newest_below(self, band: int) -> Entry | None:
        for i in range(len(self.bands) - 1, band, -1):
            b = self.bands[i]
            if b.size:
                return max((q[-1] for q in b.tenants.values()), key=lambda e: e.seq)
        return None

    def depth(self) -> dict[tuple[str, str], int]:
        """Queued requests per (tenant, band name)."""
        return {(t, BANDS[i]): len(q) for i, b in enumerate(self.bands) for t, q in b.tenants.items()}
