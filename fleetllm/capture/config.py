"""Capture settings: one dataclass, each field a ``--capture-*`` flag of ``router``, ``worker`` and ``serve``,
and a key of the fleet YAML's ``capture:`` block (the field name, without the prefix).

Torch-free (the router loads it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from fleetllm.cli_options import opt
from fleetllm.errors import UsageError, unknown_key

TIERS = ("endpoint", "access", "worker")


@dataclass
class CaptureConfig:
    """Where captured records go and which ones are kept. Off unless ``destination`` is given."""

    destination: str | None = opt(None, "capture on: a local directory or s3://bucket/prefix",
                                  flag="--capture-destination")
    tiers: list[str] = opt(doc="comma-separated tiers to capture: endpoint (router bodies, SageMaker JSONL), "
                               "access (router, one line per request), worker (prompt/output as the engine "
                               "saw them) (default: all three)", factory=lambda: list(TIERS),
                           flag="--capture-tiers")
    sampling: dict[str, str] = opt(doc="percent of requests captured at a tier, decided from the request id "
                                       "(default: 100 for every tier)", factory=dict,
                                   flag="--capture-sampling", metavar="TIER=PERCENT")
    capture_mode: Literal["both", "input", "output"] = opt("both", "endpoint and worker tiers: keep the "
                                                                   "request, the response, or both")
    content_types: list[str] = opt(doc="endpoint tier: content types captured (default: application/json, "
                                       "text/event-stream)",
                                   factory=lambda: ["application/json", "text/event-stream"],
                                   flag="--capture-content-types")
    batch_records: int = opt(1000, "records per spool segment (one object per segment)",
                             flag="--capture-batch-records")
    flush_interval_s: float = opt(10.0, "seconds before a non-empty segment is shipped anyway",
                                  flag="--capture-flush-interval")
    max_payload_kb: int = opt(1024, "largest payload kept whole (KiB); larger ones are truncated or skipped",
                              flag="--capture-max-payload-kb")
    oversize: Literal["truncate", "skip"] = opt("truncate", "what happens to a payload over the limit",
                                                flag="--capture-oversize")
    redact: list[str] = opt(doc="comma-separated regular expressions whose matches are replaced by "
                                "[REDACTED] in every payload", factory=list, flag="--capture-redact")
    redact_hook: str | None = opt(None, "module:function called with (tier, record) before writing; returns "
                                        "the record, or None to drop it", flag="--capture-redact-hook")
    spool_dir: str | None = opt(None, "write-ahead spool (default: DESTINATION/.spool for a directory, "
                                      "a private per-user directory for S3: XDG_RUNTIME_DIR, TMPDIR/...-UID or ~/.cache; "
                                      "must be owned by this user, not writable by others)",
                                flag="--capture-spool-dir")
    spool_max_mb: int = opt(1024, "spool size beyond which new records are dropped", flag="--capture-spool-max-mb")
    disk_threshold_percent: float = opt(75.0, "capture stops while the spool's disk is fuller than this",
                                        flag="--capture-disk-threshold-percent")
    max_age_s: float | None = opt(None, "local captures and spool segments older than this are deleted "
                                        "(default: kept)", flag="--capture-max-age")
    s3_endpoint_url: str | None = opt(None, "S3 API endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL)",
                                      flag="--capture-s3-endpoint-url")
    kms_key_id: str | None = opt(None, "KMS key: objects written with SSE-KMS (S3), and the key of "
                                       "--capture-envelope", flag="--capture-kms-key-id")
    envelope: bool = opt(False, "client-side envelope encryption: a KMS data key per object, AES-256-GCM",
                         flag="--capture-envelope")
    endpoint_name: str = opt("fleetllm", "endpoint name in object keys", flag="--capture-endpoint-name")
    variant: str = opt("AllTraffic", "variant name in endpoint-tier object keys", flag="--capture-variant")

    def __post_init__(self) -> None:
        unknown = (set(self.tiers) | set(self.sampling)) - set(TIERS)
        if unknown:
            raise UsageError(f"unknown capture tiers {', '.join(sorted(unknown))} (tiers: {', '.join(TIERS)})")
        if self.envelope and not self.kms_key_id:
            raise UsageError("capture envelope encryption needs a KMS key (kms_key_id, --capture-kms-key-id)")

    @property
    def enabled(self) -> bool:
        return bool(self.destination)

    def percent(self, tier: str) -> float:
        """The share of requests captured at ``tier``, in percent."""
        return float(self.sampling.get(tier, 100.0))

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, where: str = "capture") -> CaptureConfig:
        """From the fleet YAML's ``capture:`` block (keys are the field names; ``where`` is its path, which an
        unknown key's error names)."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise UsageError(unknown_key(f"{where}.{key}", known))
        for key in ("tiers", "content_types", "redact"):
            if isinstance(d.get(key), str):
                d[key] = [d[key]]
        if "sampling" in d:
            s = d["sampling"]
            d["sampling"] = {t: str(s) for t in TIERS} if isinstance(s, int | float) else {k: str(v) for k, v in s.items()}
        return cls(**d)
