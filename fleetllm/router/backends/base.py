"""What the router reads from an engine it does not own: its load, from the engine's own metric names.

A :class:`Backend` names, per load signal, the Prometheus series that carry it in that engine (several names
where an engine renamed one between versions; the first present wins, summed over its label sets, e.g. one
series per engine of a data-parallel vLLM). KV usage is a fraction of the KV pool in use (0..1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Backend:
    """One engine kind: its load series and how to recognise it."""

    kind: str
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_usage: tuple[str, ...] = ()
    owned_by: str | None = None  # what its /v1/models says in `owned_by` (detection)
    metric_prefix: str | None = None  # what its /metrics series start with (detection)

    def load(self, metrics_text: str) -> dict[str, Any]:
        """Running and waiting requests and KV usage from the engine's ``/metrics`` page (absent ones left out)."""
        samples = read_samples(metrics_text)
        out: dict[str, Any] = {}
        for key, names in (("running", self.running), ("waiting", self.waiting), ("kv_usage", self.kv_usage)):
            value = first_present(samples, names)
            if value is not None:
                out[key] = value if key == "kv_usage" else int(value)
        return out


def read_samples(text: str) -> dict[str, float]:
    """Every sample's value summed by series name (labels dropped); histograms and counters by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def first_present(samples: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in samples:
            return samples[n]
    return None
