"""Worker telemetry beyond ``/metrics``: each field a flag of ``fleetllm worker`` (some, the router's too)."""

from __future__ import annotations

from dataclasses import dataclass

from fleetllm.cli_options import opt


@dataclass
class ObservabilityConfig:
    """Where telemetry goes."""

    otlp_endpoint: str | None = opt(None, "OTLP/HTTP collector base URL (e.g. http://127.0.0.1:4318): "
                                          "metrics to /v1/metrics, request spans to /v1/traces")
    otlp_interval_s: float = opt(10.0, "seconds between OTLP metric pushes")
    log_requests: bool = opt(True, "one log line per request", flag="--disable-log-requests")
