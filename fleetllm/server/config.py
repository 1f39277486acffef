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


@dataclass
class KVEventsOptions:
    """KV events in vLLM's format, for routers that front vLLM workers (fleetllm/server/kv_publish.py)."""

    kv_events_config: str | None = opt(None, "publish KV events as vLLM does, over ZMQ: vLLM's --kv-events-config "
                                             "JSON (endpoint, topic, replay_endpoint, buffer_steps); block hashes "
                                             "rooted in PYTHONHASHSEED as vLLM's are")
    prefix_caching_hash_algo: str = opt("sha256", "vLLM's block-hash algorithm for those events",
                                        choices=("sha256", "sha256_cbor"))
