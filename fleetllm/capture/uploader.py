"""The background uploader: ships sealed spool segments to the sink, oldest first, and never loses one.

A segment is deleted only after its ``put`` returned; a failed put is retried with exponential backoff
(0.5 s doubling to 30 s) while the sink is down, and the same segment always goes to the same object
key, so a retry after an unconfirmed success overwrites rather than duplicates. ``close`` (SIGTERM,
via the server's shutdown) seals what is open and makes one last attempt; whatever it cannot ship stays
in the spool for the next start. A segment the spool rejects (not its own, or not JSON lines) is set
aside and counted; it never holds up the ones behind it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fleetllm.capture.metrics import CaptureMetrics
from fleetllm.capture.private import UnsafePath
from fleetllm.capture.sinks import Sink
from fleetllm.capture.spool import Segment, Spool

log = logging.getLogger(__name__)

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0


class Uploader:
    """A daemon thread draining ``spool`` into ``sink``; ``key(segment)`` names each object."""

    def __init__(self, spool: Spool, sink: Sink, key: Callable[[Segment], str], metrics: CaptureMetrics,
                 flush_interval_s: float, encode: Callable[[bytes], bytes] | None = None,
                 max_age_s: float | None = None) -> None:
        self.spool, self.sink, self.key, self.metrics = spool, sink, key, metrics
        self.flush_interval_s = flush_interval_s
        self.encode = encode  # envelope encryption, when configured
        self.max_age_s = max_age_s
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capture-uploader", daemon=True)
        self.backoff = 0.0
        self._next_expiry = 0.0
        self._shipping = threading.Lock()  # one drain at a time: the thread's, or a flush / close from another

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        tick = max(0.05, min(1.0, self.flush_interval_s / 2))
        while not self._stop.is_set():
            try:
                ok = self._round()
            except Exception:  # noqa: BLE001 - the thread outlives whatever one round met
                log.exception("capture uploader: a round failed; retrying")
                ok = False
            self.backoff = 0.0 if ok else min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self.backoff * 2))
            self.wake.wait(self.backoff or tick)
            self.wake.clear()

    def _round(self) -> bool:
        self._check_disk()
        self.spool.seal_due(self.flush_interval_s)
        if self.max_age_s is not None and time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + 60.0  # retention is checked once a minute
            self._expire(self.max_age_s)
        return self.drain()

    def _expire(self, max_age_s: float) -> None:
        """Retention: old spool segments, and old objects of a sink that keeps its own (a local directory)."""
        self.spool.expire(max_age_s)
        expire = getattr(self.sink, "expire", None)
        if expire is not None:
            try:
                expire(max_age_s)
            except OSError as e:
                log.warning("capture retention: %s", e)

    def _check_disk(self) -> None:
        was = self.spool.full
        if self.spool.check_disk() != was:
            log.warning("capture %s: spool disk %s %.0f%% used", "paused" if self.spool.full else "resumed",
                        "over" if self.spool.full else "under", self.spool.disk_threshold)
        self.metrics.active.set(0 if self.spool.full else 1)

    def drain(self, deadline: float | None = None) -> bool:
        """Ship every ready segment; False at the first failure (the rest wait for the retry)."""
        with self._shipping:
            for seg in self.spool.ready():
                if deadline is not None and time.monotonic() > deadline:
                    return False
                if not self._ship(seg):
                    return False
            self._gauges()
            return True

    def _ship(self, seg: Segment) -> bool:
        """True when ``seg`` is done with (shipped, or rejected as none of the spool's own)."""
        t = time.perf_counter()
        try:
            data = self.spool.read(seg)
        except UnsafePath as e:  # planted, foreign or garbled: set aside; the next segments go on
            self.spool.reject(seg.path, e.reason, counted=True)
            return True
        except FileNotFoundError:  # removed meanwhile (retention, a concurrent final drain)
            return True
        except OSError:  # unreadable (permissions, I/O error): never retried forever in front of the rest
            self.spool.reject(seg.path, "unreadable", counted=True)
            return True
        try:
            self.sink.put(self.key(seg), self.encode(data) if self.encode else data)
        except Exception as e:  # noqa: BLE001 - any sink failure is retried; the segment stays
            self.metrics.sink_errors.inc()
            log.warning("capture upload of %s failed (%s: %s); retrying", seg.path.name, type(e).__name__, e)
            self._gauges()
            return False
        self.metrics.upload_seconds.observe(time.perf_counter() - t)
        self.metrics.objects.labels(tier=seg.tier).inc()
        self.spool.remove(seg)
        return True

    def _gauges(self) -> None:
        self.metrics.spool_segments.set(self.spool.depth)
        self.metrics.spool_bytes.set(self.spool.bytes)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread, seal open segments and try to ship them; True when the spool is empty."""
        self._stop.set()
        self.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.spool.seal_due(0)
        return self.drain(time.monotonic() + timeout_s)
