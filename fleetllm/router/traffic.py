"""Traffic split between a model's variants: canaries and blue/green rollouts.

A served model may run as several *variants* (two revisions, two engine settings), each with its own copies.
Its split gives each variant a weight; a request goes to variant ``v`` with probability ``weight(v) / total``.
The choice is a hash of the request's session key (session header or ``user``) when it has one, so one user
stays on one variant for a whole conversation (and its prefix cache), and of the request id otherwise.
Variants with no routable copy are skipped: a canary whose copies are down sends its share to the others
rather than failing it. Weights change at run time (``POST /admin/traffic``) to promote or roll back a
canary without restarting anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def parse_weights(spec: str) -> dict[str, float]:
    """``"stable:90,canary:10"`` -> ``{"stable": 90.0, "canary": 10.0}`` (a ValueError naming what is wrong)."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        variant, sep, w = part.rpartition(":")
        if not sep or not variant:
            raise ValueError(f"traffic split {spec!r}: expected VARIANT:WEIGHT,..., got {part!r}")
        weights[variant] = float(w)
    check_weights(weights)
    return weights


def check_weights(weights: Mapping[str, float]) -> None:
    """Weights must be finite, non-negative and not all zero."""
    if not weights:
        raise ValueError("a traffic split needs at least one variant")
    for v, w in weights.items():
        if not isinstance(w, int | float) or not 0 <= w < float("inf"):
            raise ValueError(f"variant {v!r}: weight must be a non-negative number, got {w!r}")
    if sum(weights.values()) <= 0:
        raise ValueError("a traffic split needs a variant with a positive weight")


def unit_interval(key: str) -> float:
    """A stable point in [0, 1) for ``key`` (the same in every router and every run)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


class TrafficSplit:
    """Each split model's variant weights; :meth:`choose` picks a request's variant."""

    def __init__(self, splits: Mapping[str, Mapping[str, float]] | None = None) -> None:
        self.splits: dict[str, dict[str, float]] = {}
        for model, weights in (splits or {}).items():
            self.set(model, weights)

    def set(self, model: str, weights: Mapping[str, float]) -> None:
        check_weights(weights)
        self.splits[model] = dict(weights)

    def choose(self, model: str, key: str, available: Sequence[str]) -> str | None:
        """The variant of ``model`` for a request keyed ``key``, among ``available`` variants (those with a
        routable copy); None when the model has no split or no weighted variant is available."""
        weights = self.splits.get(model)
        if not weights:
            return None
        live = [(v, w) for v, w in weights.items() if v in available and w > 0]
        total = sum(w for _, w in live)
        if total <= 0:
            return None
        point, acc = unit_interval(key) * total, 0.0
        for v, w in live:
            acc += w
            if point < acc:
                return v
        return live[-1][0]
