"""Tenants at the router: a request's priority (checked, capped by its key) and what each tenant used.

The router checks ``priority`` itself (400 naming it, before any worker is asked) and forwards it untouched,
unless the caller's key has a ``priority_floor`` more relaxed than what the request asks (the default 0
included): the request is then served at the floor and the body rewritten (clamped, never refused, so a
batch key's clients need not know their floor). Priorities fall into three bands for accounting (and for
the flow control that will queue per band): ``high`` (< 0), ``normal`` (0) and ``low`` (> 0).

A tenant is an API key, named by its id and name (never the key). Per key and band, ``/metrics`` counts
requests, prompt and output tokens, requests shed with 429, and the time from arrival to dispatch to a
worker (the queue time in the router: held for a copy to start today, the fair-queuing wait once there is one).
Without keys every request is tenant ``none``; tokens are metered only when keys are on (it takes parsing
the answers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from fleetllm.router.keys import KeyRecord
from fleetllm.server.protocol import request_priority

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

    def admitted(self, key: KeyRecord | None, priority: int) -> None:
        self.requests.labels(**tenant_labels(key), band=band(priority)).inc()

    def refused(self, key: KeyRecord | None, priority: int, reason: str) -> None:
        self.shed.labels(**tenant_labels(key), band=band(priority), reason=reason or "limit").inc()

    def queued(self, key: KeyRecord | None, priority: int, seconds: float) -> None:
        self.queue.labels(**tenant_labels(key), band=band(priority)).observe(max(0.0, seconds))

    def used(self, key: KeyRecord | None, priority: int, prompt: int, completion: int) -> None:
        b = band(priority)
        self.tokens.labels(**tenant_labels(key), band=b, kind="prompt").inc(prompt)
        self.tokens.labels(**tenant_labels(key), band=b, kind="completion").inc(completion)
