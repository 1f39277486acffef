"""Whether a request is captured: decided from its id alone, so every tier decides the same.

The id (the router-minted ``x-fleetllm-request-id``) is hashed to a point in [0, 100); a tier keeps the
request when the point is below its percentage. Every process computes the same point, so a request
sampled at 10% is captured by the router and the worker alike, and a tier at 20% keeps a superset of
the one at 10%.
"""

from __future__ import annotations

import hashlib


def sample_point(request_id: str) -> float:
    """The request's point in [0, 100): uniform over ids, the same in every process."""
    h = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 * 100.0


def sampled(request_id: str, percent: float) -> bool:
    """True when a tier capturing ``percent`` % of requests keeps this one."""
    return percent >= 100.0 or (percent > 0.0 and sample_point(request_id) < percent)
