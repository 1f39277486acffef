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

import httpx
from prometheus_client import Counter, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.engine.params import SamplingParams
from fleetllm.server.protocol import APIError

if TYPE_CHECKING:
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
    metrics: list[TransferMetrics] = []

    def m() -> TransferMetrics:
        if not metrics:
            metrics.append(TransferMetrics(worker))
        return metrics[0]

    async def prefill(request: Request) -> Response:
        from fleetllm.disagg import frame
        from fleetllm.disagg.kv_io import export_blocks

        req = await worker._body(request)
        path, body, decode_url = req.get("path", ""), req.get("body"), req.get("decode_url")
        if not isinstance(body, dict) or not isinstance(decode_url, str):
            raise APIError(400, "give body (the request) and decode_url")
        kind = "chat" if path.endswith("/chat/completions") else "text"
        ids = worker.prompt_ids(kind, body)[0]
        rid = f"pd-{req.get('request_id') or uuid.uuid4().hex}"
        t0 = time.perf_counter()

        async def run() -> None:
            async for _ in worker.async_engine.generate(rid, ids, SamplingParams(max_tokens=1, temperature=0.0)):
                pass

        await worker._until_disconnect(request, run())  # the router gave up: abort, free the blocks
        header, layers = await worker.async_engine.call(lambda e: export_blocks(e, ids))
        prefill_s = time.perf_counter() - t0
        m().prefill_seconds.observe(prefill_s)
        via = req.get("transfer") or "http"
        t1 = time.perf_counter()
        timeout = float(req.get("timeout_s") or 60.0)
        shm_path: Path | None = None
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=3.0)) as client:
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
            m().failures.labels(reason="send").inc()
            raise APIError(502, f"KV transfer to {decode_url} failed: {type(e).__name__}: {e}") from None
        finally:
            if shm_path is not None and shm_path.exists():
                shm_path.unlink(missing_ok=True)  # never claimed: the receiver unlinks what it reads
        if r.status_code != 200:
            m().failures.labels(reason=f"rejected_{r.status_code}").inc()
            raise APIError(502, f"the decode worker refused the KV frame ({r.status_code}): {r.text[:200]}")
        transfer_s = time.perf_counter() - t1
        m().bytes.labels(direction="sent", via=via).inc(nbytes)
        m().seconds.labels(direction="sent").observe(transfer_s)
        m().blocks.labels(kind="sent").inc(header.num_blocks)
        return JSONResponse({"blocks": header.num_blocks, "bytes": nbytes, "prompt_tokens": len(ids),
                             "prefill_s": prefill_s, "transfer_s": transfer_s, "via": via, **r.json()})

    async def receive(request: Request) -> Response:
        from fleetllm.disagg.frame import FrameError, decode
        from fleetllm.disagg.kv_io import import_blocks

        t0 = time.perf_counter()
        via = "http"
        if request.headers.get("content-type", "").startswith("application/json"):
            spec = await worker._body(request)
            p = Path(str(spec.get("shm", "")))
            if p.parent != SHM_DIR or not p.name.startswith("fleetllm-kv-"):
                raise APIError(400, "shm must name a fleetllm-kv-* file in the shared-memory directory", "shm")
            try:
                data = await asyncio.to_thread(p.read_bytes)
            except OSError as e:
                m().failures.labels(reason="shm_read").inc()
                raise APIError(400, f"cannot read {p}: {e}", "shm") from None
            finally:
                p.unlink(missing_ok=True)
            via = "shm"
        else:
            data = await request.body()
        try:
            header, layers = await asyncio.to_thread(decode, data)
            result = await worker.async_engine.call(lambda e: import_blocks(e, header, layers))
        except FrameError as e:
            m().failures.labels(reason="bad_frame").inc()
            raise APIError(400, f"bad KV frame: {e}") from None
        m().bytes.labels(direction="received", via=via).inc(len(data))
        m().seconds.labels(direction="received").observe(time.perf_counter() - t0)
        m().blocks.labels(kind="imported").inc(result["imported"])
        m().blocks.labels(kind="already_cached").inc(result["already_cached"])
        return JSONResponse(result)

    return [Route("/pd/prefill", prefill, methods=["POST"]), Route("/pd/kv", receive, methods=["POST"])]


def _write_frame(path: Path, pieces: Any) -> int:
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        for piece in pieces:
            f.write(piece)
            n += len(piece)
    return n
