"""The worker's disaggregation endpoints: the route table and the transfer metrics both sides share.

- Prefill side (:mod:`.prefill_side`): ``POST /pd/prefill`` computes a prompt's KV and ships it to a decode
  worker: straight into its shared pool (same host, :mod:`.direct`), else as a frame (shared memory or HTTP).
- Decode side (:mod:`.decode_side`): ``POST /pd/kv`` imports a frame; ``POST /pd/reserve``, ``/pd/commit``
  and ``/pd/release`` hold, register and free pool blocks for a direct write (:mod:`.leases`); ``POST
  /pd/first`` gives a handed-over prompt its first token and ``POST /pd/abandon`` ends a transfer the router
  gave up (:mod:`.handoffs`).

Torch is imported lazily: simulated workers (no torch) serve the same app without these endpoints working.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from starlette.routing import Route

from fleetllm.disagg.config import TransferOptions

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.server.app import Worker

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    """A worker's KV transfer metrics (both sides)."""

    def __init__(self, worker: Worker) -> None:
        r = worker.engine.metrics.registry
        self.bytes = Counter("fleetllm:kv_transfer_bytes", "KV bytes sent or received (via http or shm: frames; via "
                             "pool: written into a same-host decode worker's pool).", ["direction", "via"], registry=r)
        self.seconds = Histogram("fleetllm:kv_transfer_seconds", "Time to ship (sent: from the KV's completion to "
                                 "the decode worker's answer) or verify and import (received) one KV frame.",
                                 ["direction"], buckets=_SECONDS, registry=r)
        self.blocks = Counter("fleetllm:kv_transfer_blocks", "KV blocks sent, imported, or already cached on arrival.",
                              ["kind"], registry=r)
        self.failures = Counter("fleetllm:kv_transfer_failures", "Failed transfers by reason.", ["reason"], registry=r)
        self.prefill_seconds = Histogram("fleetllm:pd_prefill_seconds", "Remote-prefill time on this worker, until "
                                         "its KV frame is complete.", buckets=_SECONDS, registry=r)
        self.handoff_waits = Histogram("fleetllm:pd_handoff_wait_seconds", "Time a request forwarded during its "
                                       "remote prefill waited for it, by how the wait ended: handed_over (its KV "
                                       "and first token arrived), ended (plainly imported, or the router abandoned "
                                       "the transfer: prefilled here), timeout.", ["outcome"], buckets=_SECONDS,
                                       registry=r)


CONTROL_BODY_BYTES = 64 * 2**10  # a commit, release, first token (its sampler state included) or abandon


def frame_body_cap(engine: LLMEngine) -> int:
    """The largest KV frame worth reading (``POST /pd/kv``): the whole KV pool in fp32, its header included."""
    cfg, tokens = engine.loaded.config, engine.pool.num_blocks * engine.pool.block_size
    return tokens * (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 + 8) + engine.pool.num_blocks * 24


def pd_body_caps(engine: LLMEngine, max_body_bytes: int) -> dict[str, int]:
    """Each ``/pd/*`` route's largest body: a frame (``/pd/kv``) the pool's size; a reservation its header (a
    token id and a share of a block hash per token of the longest prompt); the other control messages
    small; ``/pd/prefill`` carries a client's request (``max_body_bytes``)."""
    caps = dict.fromkeys(("/pd/commit", "/pd/release", "/pd/first", "/pd/abandon"), CONTROL_BODY_BYTES)
    return {**caps, "/pd/kv": max_body_bytes + frame_body_cap(engine),
            "/pd/reserve": CONTROL_BODY_BYTES + 16 * engine.max_model_len}


class LazyMetrics:
    """A worker's :class:`TransferMetrics`, registered on first use: a worker that never transfers shows none."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._metrics: TransferMetrics | None = None

    def get(self) -> TransferMetrics:
        if self._metrics is None:
            self._metrics = TransferMetrics(self.worker)
        return self._metrics


def pd_routes(worker: Worker, options: TransferOptions | None = None) -> list[Route]:
    """The ``/pd/*`` routes of ``worker``."""
    from fleetllm.disagg.connector import pd_connector
    from fleetllm.disagg.decode_side import DecodeEndpoints
    from fleetllm.disagg.prefill_side import PrefillEndpoints

    connector = pd_connector(worker.engine)  # how a prefill here reaches the engine's steps, a transfer its pool
    metrics = LazyMetrics(worker)
    p, d = PrefillEndpoints(worker, metrics, connector, options), DecodeEndpoints(worker, metrics, connector)
    worker.handoffs.observe = lambda outcome, s: metrics.get().handoff_waits.labels(outcome=outcome).observe(s)
    decode = ("reserve", "commit", "release", "first", "abandon")
    return [Route("/pd/prefill", p.prefill, methods=["POST"]), Route("/pd/kv", d.receive, methods=["POST"]),
            *(Route(f"/pd/{name}", getattr(d, name), methods=["POST"]) for name in decode)]
