"""OTLP/HTTP export of a Prometheus registry: the same metrics ``/metrics`` serves, pushed periodically.

Instead of recording every observation twice (Prometheus and OTel instruments), a background thread
reads the registry and converts it: counters -> cumulative monotonic sums, gauges -> gauges,
histograms -> explicit-bucket histograms. The GenAI metrics get back their OpenTelemetry names and
units (``gen_ai_server_time_to_first_token_seconds`` -> ``gen_ai.server.time_to_first_token``, s);
label names are OTel attributes (``gen_ai_token_type`` -> ``gen_ai.token.type``).
"""

from __future__ import annotations

import logging
import math
import threading
import time

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric as PromMetric

log = logging.getLogger(__name__)

# Prometheus name -> (OTel name, unit) for the OpenTelemetry GenAI metrics
OTEL_NAMES = {
    "gen_ai_server_time_to_first_token_seconds": ("gen_ai.server.time_to_first_token", "s"),
    "gen_ai_server_time_per_output_token_seconds": ("gen_ai.server.time_per_output_token", "s"),
    "gen_ai_server_request_duration_seconds": ("gen_ai.server.request.duration", "s"),
    "gen_ai_client_token_usage": ("gen_ai.client.token.usage", "{token}"),
}
OTEL_ATTRIBUTES = {"gen_ai_token_type": "gen_ai.token.type"}


def otlp_url(endpoint: str, signal: str) -> str:
    """``http://host:4318`` -> ``http://host:4318/v1/<signal>`` (a full signal URL is kept)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(f"/v1/{signal}") else f"{endpoint}/v1/{signal}"


def resource_for(service: str, labels: dict[str, str]):
    from opentelemetry.sdk.resources import Resource

    attrs = {"service.name": service, **{f"fleetllm.{k}": v for k, v in labels.items() if v}}
    return Resource.create(attrs)


def _attrs(labels: dict[str, str]) -> dict[str, str]:
    return {OTEL_ATTRIBUTES.get(k, k): v for k, v in labels.items()}


def _convert(fam: PromMetric, start_ns: int, now_ns: int):
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Histogram,
        HistogramDataPoint,
        Metric,
        NumberDataPoint,
        Sum,
    )

    name, unit = OTEL_NAMES.get(fam.name, (fam.name, "s" if fam.name.endswith("_seconds") else ""))
    cumulative = AggregationTemporality.CUMULATIVE
    if fam.type in ("counter", "gauge"):
        suffix = "_total" if fam.type == "counter" else ""
        points = [NumberDataPoint(_attrs(s.labels), start_ns, now_ns, s.value)
                  for s in fam.samples if s.name == fam.name + suffix]
        if not points:
            return None
        data = Sum(points, cumulative, True) if fam.type == "counter" else Gauge(points)
        return Metric(name, fam.documentation, unit, data)
    if fam.type != "histogram":
        return None
    series: dict[tuple, dict] = {}
    for s in fam.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        d = series.setdefault(tuple(sorted(labels.items())), {"labels": labels, "buckets": []})
        if s.name.endswith("_bucket"):
            d["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_sum"):
            d["sum"] = s.value
        elif s.name.endswith("_count"):
            d["count"] = s.value
    points = []
    for d in series.values():
        les = sorted(d["buckets"])
        cum = [int(v) for _, v in les]
        counts = [c - p for c, p in zip(cum, [0, *cum[:-1]], strict=True)]
        bounds = [le for le, _ in les if not math.isinf(le)]
        points.append(HistogramDataPoint(_attrs(d["labels"]), start_ns, now_ns, int(d.get("count", 0)),
                                         d.get("sum", 0.0), counts, bounds, None, None))
    return Metric(name, fam.documentation, unit, Histogram(points, cumulative))


def registry_to_metrics_data(registry: CollectorRegistry, resource, start_ns: int, scope: str = "fleetllm"):
    """One snapshot of ``registry`` as OTLP-ready MetricsData."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    now_ns = time.time_ns()
    metrics = [m for fam in registry.collect() if (m := _convert(fam, start_ns, now_ns)) is not None]
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(InstrumentationScope(scope), metrics, "")], "")])


class OTLPMetricsPusher:
    """Pushes ``registry`` to ``endpoint`` (OTLP/HTTP protobuf) every ``interval_s`` and once at stop."""

    def __init__(self, registry: CollectorRegistry, endpoint: str, resource, interval_s: float = 10.0) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        self.registry, self.resource, self.interval_s = registry, resource, interval_s
        self.exporter = OTLPMetricExporter(endpoint=otlp_url(endpoint, "metrics"), timeout=5)
        self.start_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="otlp-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def push(self) -> bool:
        try:
            result = self.exporter.export(registry_to_metrics_data(self.registry, self.resource, self.start_ns))
        except Exception as e:  # noqa: BLE001 - a collector that is down must never hurt serving
            log.warning("OTLP metrics export failed: %s", e)
            return False
        return result.name == "SUCCESS"

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.push()
        self.exporter.shutdown()
