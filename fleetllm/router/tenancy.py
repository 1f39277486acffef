"""Tenants at the router: a request's priority (checked, capped by its key) and what each tenant used.

The router checks ``priority`` itself (400 naming it, before any worker is asked) and forwards it untouched,
unless the caller's key has a ``priority_floor`` more relaxed than what the request asks (the default 0
included): the request is then served at the floor and the body rewritten (clamped, never refused, so a
batch key's clients need not know their floor). Priorities fall into three bands, for accounting and for
the flow control that queues per band (:mod:`fleetllm.router.pipeline.admission`): ``high`` (< 0), ``normal``
(0) and ``low`` (> 0).

A tenant is an API key, named by its id and name (never the key). Per key and band, ``/metrics`` counts
requests, prompt and output tokens, requests shed (by the key's limits, or by flow control: ``queue_full``,
``displaced``, ``deadline``), requests waiting in the fair queue, and the time from arrival to dispatch to a
worker (the queue time in the router: held for a copy to start, and the fair-queuing wait).
Without keys the metrics name every tenant ``none`` (the ``x-tenant-id`` or ``user`` that flow control queues
apart are no labels: their number is unbounded); tokens are metered only when keys are on (it takes parsing
the answers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetllm.router.keys import KeyRecord
from fleetllm.server.protocol import APIError, request_priority

_QUEUE = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def band(priority: int) -> str:
    """The accounting band of a priority: ``high`` (< 0), ``normal`` (0) or ``low`` (> 0)."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


def effective_priority(body: dict[str, Any], key: KeyRecord | None) -> int:
    """The request's priority as it will be served: checked (APIError 400 naming ``priority``), then raised
    to its key's ``priority_floor``; ``body`` is rewritten when the floor applies."""
    asked = request_priority(body)
    floor = key.priority_floor if key is not None else None
    if floor is not None and asked < floor:
        body["priority"] = floor
        return floor
    return asked


def tenant_labels(key: KeyRecord | None) -> Mapping[str, str]:
    return {"key": key.id, "name": key.name} if key is not None else {"key": "none", "name": ""}


TENANT_HEADER = "x-tenant-id"
MAX_TENANT_BYTES = 256


@dataclass(frozen=True)
class Tenant:
    """Whose request it is, for fair queuing: ``id`` queues apart, ``weight`` its share, ``key`` its labels."""

    id: str
    weight: float = 1.0
    key: KeyRecord | None = None


def tenant_of(key: KeyRecord | None, headers: Mapping[str, str], body: Mapping[str, Any]) -> Tenant:
    """The request's tenant: its API key (weighted by the key's ``weight``); with keys off, the ``x-tenant-id``
    header, else the body's ``user``, else one shared tenant. APIError 400 for a name over 256 bytes (it is kept
    while the request queues)."""
    if key is not None:
        return Tenant(key.id, key.weight, key)
    name = headers.get(TENANT_HEADER)
    param = TENANT_HEADER
    if name is None and isinstance(body.get("user"), str):
        name, param = body["user"], "user"
    if name and len(name.encode()) > MAX_TENANT_BYTES:
        raise APIError(400, f"{param} is longer than {MAX_TENANT_BYTES} bytes", param)
    return Tenant(name or "none")


class TenantMetrics:
    """``fleetllm_tenant_*``: per key (id and name) and priority band."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["key", "name", "band"]
        self.requests = Counter("fleetllm_tenant_requests", "Requests admitted per key and priority band.", labels,
                                registry=registry)
        self.tokens = Counter("fleetllm_tenant_tokens", "Tokens per key and priority band (kind: prompt | "
                              "completion); metered when keys are on.", [*labels, "kind"], registry=registry)
        self.shed = Counter("fleetllm_tenant_shed", "Requests refused with 429 per key and priority band, by the "
                            "limit that refused them.", [*labels, "reason"], registry=registry)
        self.queue = Histogram("fleetllm_tenant_queue_seconds", "Arrival at the router to dispatch to a worker, per "
                               "key and priority band.", labels, buckets=_QUEUE, registry=registry)
        self.depth = Gauge("fleetllm_tenant_queued", "Requests waiting in the router's fair queue (--flow-control) "
                            "per key and priority band.", labels, registry=registry)

    def admitted(self, key: KeyRecord | None, priority: int) -> None:
        self.requests.labels(**tenant_labels(key), band=band(priority)).inc()

    def refused(self, key: KeyRecord | None, priority: int, reason: str) -> None:
        self.shed.labels(**tenant_labels(key), band=band(priority), reason=reason or "limit").inc()

    def refused_tenant(self, tenant: Tenant, band_name: str, reason: str) -> None:
        """A request the admission stage shed (``queue_full``, ``displaced``, ``deadline``)."""
        self.shed.labels(**tenant_labels(tenant.key), band=band_name, reason=reason).inc()

    def waiting(self, tenant: Tenant, band_name: str, delta: int) -> None:
        self.depth.labels(**tenant_labels(tenant.key), band=band_name).inc(delta)

    def queued(self, key: KeyRecord | None, priority: int, seconds: float) -> None:
        self.queue.labels(**tenant_labels(key), band=band(priority)).observe(max(0.0, seconds))

    def used(self, key: KeyRecord | None, priority: int, prompt: int, completion: int) -> None:
        b = band(priority)
        self.tokens.labels(**tenant_labels(key), band=b, kind="prompt").inc(prompt)
        self.tokens.labels(**tenant_labels(key), band=b, kind="completion").inc(completion)
