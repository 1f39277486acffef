"""The worker's disaggregation endpoints.

``POST /pd/prefill`` (any role; the router sends it to prefill workers)::

    {"path": "/v1/chat/completions", "body": {...the client's request...}, "decode_url": "http://...",
     "transfer": "shm" | "http", "request_id": "..."}

computes the prompt's KV (one sampled token, then stop), exports its full blocks and pushes them to the
decode worker's ``POST /pd/kv``, over shared memory (a file in /dev/shm, same host) or streamed over
HTTP. It answers ``{"blocks", "bytes", "prefill_s", "transfer_s", ...}`` or an error status.

``POST /pd/kv`` (decode side) takes a frame (``application/octet-stream``) or ``{"shm": path}``,
verifies it completely, and imports its blocks into the prefix cache. A bad frame is a 400 and
imports nothing. Transfer bytes, seconds and failures are metrics on both sides.

Torch is imported lazily: simulated workers (no torch) serve the same app without these endpoints working.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.engine.params import SamplingParams
from fleetllm.server.protocol import APIError
from fleetllm.server.worker_secret import worker_secret

if TYPE_CHECKING:
    import httpx

    from fleetllm.server.app import Worker

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    def __init__(self, worker: Worker) -> None:
        r = worker.engine.metrics.registry
        self.bytes = Counter("fleetllm:kv_transfer_bytes", "KV frame bytes sent or received.", ["direction", "via"], registry=r)
        self.seconds = Histogram("fleetllm:kv_transfer_seconds", "Time to ship (sent) or verify and import "
                                 "(received) one KV frame.", ["direction"], buckets=_SECONDS, registry=r)
        self.blocks = Counter("fleetllm:kv_transfer_blocks", "KV blocks sent, imported, or already cached on arrival.",
                              ["kind"], registry=r)
        self.failures = Counter("fleetllm:kv_transfer_failures", "Failed transfers by reason.", ["reason"], registry=r)
        self.prefill_seconds = Histogram("fleetllm:pd_prefill_seconds", "Remote-prefill compute time on this worker.",
                                         buckets=_SECONDS, registry=r)


def pd_routes(worker: Worker) -> list[Route]:
    """The ``/pd/prefill`` and ``/pd/kv`` routes of ``worker``."""
    ep = PDEndpoints(worker)
    return [Route("/pd/prefill", ep.prefill, methods=["POST"]), Route("/pd/kv", ep.receive, methods=["POST"])]


class PDEndpoints:
    """The two disaggregation endpoints of one worker, built on its public request helpers."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._metrics: TransferMetrics | None = None

    @property
    def metrics(self) -> TransferMetrics:
        # registered on first use: a worker that never transfers shows no transfer series
        if self._metrics is None:
            self._metrics = TransferMetrics(self.worker)
        return self._metrics

    # ---- prefill side ----------------------------------------------------------------------------------
    async def prefill(self, request: Request) -> Response:
        """Compute the prompt's KV, ship its full blocks to the decode worker, answer what was shipped."""
        from fleetllm.disagg.kv_io import export_blocks

        req = await self.worker.request_body(request)
        path, body, decode_url = req.get("path", ""), req.get("body"), req.get("decode_url")
        if not isinstance(body, dict) or not isinstance(decode_url, str):
            raise APIError(400, "give body (the request) and decode_url")
        kind = "chat" if path.endswith("/chat/completions") else "text"
        ids = self.worker.prompt_ids(kind, body)[0]
        rid = f"pd-{req.get('request_id') or uuid.uuid4().hex}"
        t0 = time.perf_counter()
        await self.worker.until_disconnect(request, self._compute(rid, ids))  # the router gave up: abort, free the blocks
        header, layers = await self.worker.async_engine.call(lambda e: export_blocks(e, ids))
        prefill_s = time.perf_counter() - t0
        self.metrics.prefill_seconds.observe(prefill_s)
        via = req.get("transfer") or "http"
        t1 = time.perf_counter()
        r, nbytes = await self._ship(header, layers, decode_url, via, float(req.get("timeout_s") or 60.0))
        transfer_s = time.perf_counter() - t1
        self.metrics.bytes.labels(direction="sent", via=via).inc(nbytes)
        self.metrics.seconds.labels(direction="sent").observe(transfer_s)
        self.metrics.blocks.labels(kind="sent").inc(header.num_blocks)
        return JSONResponse({"blocks": header.num_blocks, "bytes": nbytes, "prompt_tokens": len(ids),
                             "prefill_s": prefill_s, "transfer_s": transfer_s, "via": via, **r.json()})

    async def _compute(self, rid: str, ids: list[int]) -> None:
        # one greedy token: the prompt's blocks are then computed and sit in the prefix cache
        async for _ in self.worker.async_engine.generate(rid, ids, SamplingParams(max_tokens=1, temperature=0.0)):
            pass

    async def _ship(self, header: Any, layers: Any, decode_url: str, via: str, timeout: float) -> tuple[httpx.Response, int]:
        """POST the frame to the decode worker's ``/pd/kv``; its answer (200 only) and the bytes sent."""
        import httpx  # only a prefill worker sends; httpx (with its CLI's rich/click) stays out of every start

        from fleetllm.disagg import frame

        shm_path: Path | None = None
        try:
            secret = worker_secret()  # a fleet with keys: the decode worker takes requests from its fleet only
            auth = {"authorization": f"Bearer {secret}"} if secret else None
            async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=3.0), headers=auth) as client:
                if via == "shm":
                    shm_path = SHM_DIR / f"fleetllm-kv-{uuid.uuid4().hex}"
                    nbytes = await asyncio.to_thread(_write_frame, shm_path, frame.encode(header, layers))
                    r = await client.post(decode_url + "/pd/kv", json={"shm": str(shm_path)})
                else:
                    sent = [0]

                    async def pieces() -> AsyncIterator[bytes]:
                        for piece in frame.encode(header, layers):  # one layer at a time on the wire
                            sent[0] += len(piece)
                            yield piece

                    r = await client.post(decode_url + "/pd/kv", content=pieces(),
                                          headers={"content-type": "application/octet-stream"})
                    nbytes = sent[0]
        except httpx.HTTPError as e:
            self.metrics.failures.labels(reason="send").inc()
            raise APIError(502, f"KV transfer to {decode_url} failed: {type(e).__name__}: {e}") from None
        finally:
            if shm_path is not None and shm_path.exists():
                shm_path.unlink(missing_ok=True)  # never claimed: the receiver unlinks what it reads
        if r.status_code != 200:
            self.metrics.failures.labels(reason=f"rejected_{r.status_code}").inc()
            raise APIError(502, f"the decode worker refused the KV frame ({r.status_code}): {r.text[:200]}")
        return r, nbytes

    # ---- decode side -----------------------------------------------------------------------------------
    async def receive(self, request: Request) -> Response:
        """Verify a frame and import its blocks into this worker's prefix cache."""
        from fleetllm.disagg.frame import FrameError, decode
        from fleetllm.disagg.kv_io import import_blocks

        t0 = time.perf_counter()
        data, via = await self._read_frame(request)
        try:
            header, layers = await asyncio.to_thread(decode, data)
            result = await self.worker.async_engine.call(lambda e: import_blocks(e, header, layers))
        except FrameError as e:
            self.metrics.failures.labels(reason="bad_frame").inc()
            raise APIError(400, f"bad KV frame: {e}") from None
        self.metrics.bytes.labels(direction="received", via=via).inc(len(data))
        self.metrics.seconds.labels(direction="received").observe(time.perf_counter() - t0)
        self.metrics.blocks.labels(kind="imported").inc(result["imported"])
        self.metrics.blocks.labels(kind="already_cached").inc(result["already_cached"])
        return JSONResponse(result)

    async def _read_frame(self, request: Request) -> tuple[bytes, str]:
        """The frame's bytes, from the body or from the shared-memory file it names; and which way it came."""
        if not request.headers.get("content-type", "").startswith("application/json"):
            return await request.body(), "http"
        spec = await self.worker.request_body(request)
        p = Path(str(spec.get("shm", "")))
        if p.parent != SHM_DIR or not p.name.startswith("fleetllm-kv-"):
            raise APIError(400, "shm must name a fleetllm-kv-* file in the shared-memory directory", "shm")
        try:
            return await asyncio.to_thread(p.read_bytes), "shm"
        except OSError as e:
            self.metrics.failures.labels(reason="shm_read").inc()
            raise APIError(400, f"cannot read {p}: {e}", "shm") from None
        finally:
            p.unlink(missing_ok=True)


def _write_frame(path: Path, pieces: Any) -> int:
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        for piece in pieces:
            f.write(piece)
            n += len(piece)
    return n
