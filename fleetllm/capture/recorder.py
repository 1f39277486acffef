"""One process's capture: which tiers it writes, sampling, payload limits, redaction, spool and uploader.

The router and the worker each hold one :class:`Capture` (their taps, :mod:`.router_tap` and
:mod:`.worker_tap`, build the records). Everything a request pays for happens in :meth:`Capture.write`:
a hash, a ``json.dumps`` and one ``os.write``; shipping is the uploader thread's job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from fleetllm.capture import envelope
from fleetllm.capture.config import CaptureConfig
from fleetllm.capture.metrics import CaptureMetrics
from fleetllm.capture.private import default_root, private_dir
from fleetllm.capture.redaction import Redactor
from fleetllm.capture.sampling import sampled
from fleetllm.capture.sinks import Sink, make_sink
from fleetllm.capture.spool import Segment, Spool
from fleetllm.capture.uploader import Uploader

log = logging.getLogger(__name__)
TRUNCATED = "...[truncated by fleetllm capture: {n} bytes]"


class Capture:
    """Capture for one process (``component``: ``router``, or ``worker-HOST-PORT``)."""

    def __init__(self, cfg: CaptureConfig, component: str, tiers: tuple[str, ...],
                 registry: CollectorRegistry | None = None, sink: Sink | None = None) -> None:
        assert cfg.destination, "capture needs a destination"
        self.cfg = cfg
        self.component = _safe(component)
        self.tiers = set(tiers) & set(cfg.tiers)  # what this process captures (router: endpoint, access)
        self.metrics = CaptureMetrics(registry)
        self.redactor = Redactor(cfg.redact, cfg.redact_hook)
        self.max_payload = cfg.max_payload_kb * 1024
        self.spool = Spool(private_dir(spool_dir(cfg)) / self.component, cfg.batch_records,
                           cfg.spool_max_mb * 1024 * 1024, cfg.disk_threshold_percent,
                           lambda reason: self.metrics.spool_rejected.labels(reason=reason).inc())
        self.sink = sink or make_sink(cfg.destination, cfg.s3_endpoint_url, cfg.kms_key_id)
        encode = None
        if cfg.envelope:
            import boto3

            kms = boto3.client("kms", endpoint_url=cfg.s3_endpoint_url)
            encode = lambda data: envelope.seal(data, kms, cfg.kms_key_id)  # noqa: E731
        self.uploader = Uploader(self.spool, self.sink, self.object_key, self.metrics, cfg.flush_interval_s, encode,
                                 cfg.max_age_s)
        if self.spool.recovered:
            log.info("capture: %d spool segment(s) left by a previous run will be shipped", self.spool.recovered)

    def start(self) -> None:
        """Start shipping (the spool a previous run left first)."""
        self.metrics.active.set(1)
        self.uploader.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush: seal and ship what is spooled; what cannot be shipped now waits for the next start."""
        if not self.uploader.close(timeout_s):
            log.warning("capture: %d segment(s) not shipped at shutdown; they stay in %s", self.spool.depth,
                        self.spool.dir)

    def wants(self, tier: str, request_id: str) -> bool:
        """Whether ``tier`` captures this request (counted ``sampled_out`` when not)."""
        if tier not in self.tiers:
            return False
        if sampled(request_id, self.cfg.percent(tier)):
            return True
        self.metrics.count(tier, "sampled_out")
        return False

    def keeps(self, side: str) -> bool:
        """``input`` / ``output``: whether the capture mode keeps that side of a request."""
        return self.cfg.capture_mode in ("both", side)

    def payload(self, tier: str, text: str, flags: set[str], is_json: bool = False) -> str | None:
        """``text`` redacted (string by string when ``is_json``) and within the payload limit; None when it
        must be skipped.

        ``flags`` collects ``redacted`` / ``truncated`` for the record's counters."""
        text, hit = self.redactor.json_text(text) if is_json else self.redactor.text(text)
        if hit:
            flags.add("redacted")
        size = len(text.encode())
        if size <= self.max_payload:
            return text
        if self.cfg.oversize == "skip":
            return None
        flags.add("truncated")
        return text.encode()[:self.max_payload].decode(errors="ignore") + TRUNCATED.format(n=size)

    @contextlib.contextmanager
    def guard(self, tier: str) -> Iterator[None]:
        """Capture never fails a request: a record that cannot be built is logged and counted dropped."""
        try:
            yield
        except Exception:  # noqa: BLE001 - whatever broke, the request goes on
            log.exception("capture: a %s record could not be written", tier)
            self.metrics.count(tier, "dropped")

    def write(self, tier: str, record: dict[str, Any] | None, flags: Iterable[str] = ()) -> bool:
        """Append a finished record to the spool; never waits (refused: counted ``dropped``)."""
        if record is not None:
            record = self.redactor.record(tier, record)
        if record is None:
            self.metrics.count(tier, "skipped")
            return False
        line = (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        ok = self.spool.append(tier, line)
        self.metrics.count(tier, "written" if ok else "dropped")
        if ok:
            self.metrics.count_bytes(tier, len(line))
            for f in flags:
                self.metrics.count(tier, f)
            if self.spool.ready_waiting():
                self.uploader.wake.set()
        return ok

    def object_key(self, seg: Segment) -> str:
        """Where a spool segment goes: SageMaker's layout for the endpoint tier, beside it for the others."""
        t = datetime.fromtimestamp(seg.created_ms / 1000, UTC)
        name = f"{t:%Y/%m/%d/%H}/{t:%M-%S}-{seg.created_ms % 1000:03d}-{seg.uid}.jsonl"
        cfg = self.cfg
        base = {"endpoint": f"{cfg.endpoint_name}/{cfg.variant}",
                "access": f"{cfg.endpoint_name}/_access/{self.component}",
                "worker": f"{cfg.endpoint_name}/_worker/{self.component}"}[seg.tier]
        return f"{base}/{name}" + (envelope.SUFFIX if cfg.envelope else "")


def spool_dir(cfg: CaptureConfig) -> Path:
    """The spool's root: configured, else beside a local destination, else per S3 destination in a private
    per-user directory (:func:`.private.default_root`: ``$XDG_RUNTIME_DIR``, ``TMPDIR/...-UID``, ``~/.cache``)."""
    if cfg.spool_dir:
        return Path(cfg.spool_dir)
    dest = cfg.destination or ""
    if not dest.startswith("s3://"):
        return Path(dest) / ".spool"
    return default_root("fleetllm-capture-spool") / _safe(dest[5:])


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "capture"
