"""Capture's Prometheus series (``fleetllm_capture_*``), registered in the process's own registry.

``records_total{tier, outcome}``: ``written``, ``sampled_out`` and ``dropped`` (the spool refused it),
``skipped`` (over the payload limit with ``oversize: skip``, or dropped by the redaction hook) are
exclusive; ``truncated`` and ``redacted`` count written records that were cut or had a pattern masked.
``spool_rejected_total{reason}`` counts files in the spool that were set aside unshipped (``symlink``,
``foreign_owner``, ``hard_link``, ``not_regular``, ``name``, ``malformed``, ``unreadable``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_UPLOAD = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class CaptureMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.records = Counter("fleetllm_capture_records", "Capture records per tier, by outcome (written, "
                               "sampled_out, dropped, skipped, truncated, redacted).", ["tier", "outcome"], registry=r)
        self.bytes = Counter("fleetllm_capture_bytes", "Bytes of capture records written to the spool.", ["tier"],
                             registry=r)
        self.objects = Counter("fleetllm_capture_objects", "Spool segments shipped to the sink.", ["tier"], registry=r)
        self.upload_seconds = Histogram("fleetllm_capture_upload_seconds", "Time to ship one spool segment.",
                                        buckets=_UPLOAD, registry=r)
        self.sink_errors = Counter("fleetllm_capture_sink_errors", "Failed uploads (retried with backoff).",
                                   registry=r)
        self.spool_segments = Gauge("fleetllm_capture_spool_segments", "Spool segments not yet shipped.", registry=r)
        self.spool_bytes = Gauge("fleetllm_capture_spool_bytes", "Bytes in the spool not yet shipped.", registry=r)
        self.spool_rejected = Counter("fleetllm_capture_spool_rejected", "Files in the spool set aside "
                                      "unshipped: not written by capture, or not whole JSON lines.", ["reason"],
                                      registry=r)
        self._children: dict[tuple[int, str, str], Counter] = {}
        self.active = Gauge("fleetllm_capture_active", "1 while capture writes; 0 while paused (spool disk past "
                            "its use threshold).", registry=r)

    def count(self, tier: str, outcome: str, n: int = 1) -> None:
        """``records_total{tier, outcome} += n`` (children cached: this runs in every captured request)."""
        self._child(self.records, tier, outcome).inc(n)

    def count_bytes(self, tier: str, n: int) -> None:
        self._child(self.bytes, tier, "").inc(n)

    def _child(self, counter: Counter, tier: str, outcome: str) -> Counter:
        key = (id(counter), tier, outcome)
        child = self._children.get(key)
        if child is None:
            child = counter.labels(tier=tier, outcome=outcome) if outcome else counter.labels(tier=tier)
            self._children[key] = child
        return child
