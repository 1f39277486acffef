"""The worker's disaggregation endpoints.

``POST /pd/prefill`` (any role; the router sends it to prefill workers)::

    {"path": "/v1/chat/completions", "body": {...the client's request...}, "decode_url": "http://...",
     "transfer": "shm" | "http", "request_id": "..."}

computes the prompt's KV (one sampled token, then stop) and ships its full blocks to the decode worker's
``POST /pd/kv``. The frame is built while the prefill runs: after each decoder layer, the blocks it has
just written go straight from the pool into the frame (:mod:`.layer_stream`), and in the prompt's last
step each layer is sealed and announced while later layers still compute. Over shared memory (same host)
the frame lives in a mapped file in /dev/shm that the decode worker maps too, the POST body saying
which file and then one byte per layer made final; over HTTP the body is the frame, each layer sent
as soon as it is sealed. It answers ``{"blocks", "bytes", "prefill_s", "transfer_s", ...}`` or an error
status: ``prefill_s`` runs until the frame is complete, ``transfer_s`` from then to the decode
worker's answer (what the overlap left exposed).

``POST /pd/kv`` (decode side) takes a frame (``application/octet-stream``), a shared-memory file being
filled (:data:`.arrival.SHM_STREAM`), or a finished one (``{"shm": path, "bytes": n, "keep": bool}``; without
keep the receiver unlinks it). Each layer is verified (CRC) as soon as it is in and copied from the
frame's bytes straight into pool blocks reserved for it, off the engine thread (see :mod:`.kv_io`); the
blocks are registered only once the trailer checks out. A bad frame is a 400 and imports nothing.
Transfer bytes, seconds and failures are metrics on both sides.

Torch is imported lazily: simulated workers (no torch) serve the same app without these endpoints working.
"""

from __future__ import annotations

import asyncio
import json
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

from fleetllm.disagg.buffers import PREFIX, Buffer, FrameBuffers
from fleetllm.disagg.config import TransferOptions
from fleetllm.engine.params import SamplingParams
from fleetllm.server.protocol import APIError
from fleetllm.server.worker_secret import worker_secret

if TYPE_CHECKING:
    import httpx

    from fleetllm.disagg.arrival import Mappings
    from fleetllm.disagg.frame import FrameBuffer
    from fleetllm.disagg.layer_stream import LayerStream
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.server.app import Worker

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    def __init__(self, worker: Worker) -> None:
        r = worker.engine.metrics.registry
        self.bytes = Counter("fleetllm:kv_transfer_bytes", "KV frame bytes sent or received.", ["direction", "via"], registry=r)
        self.seconds = Histogram("fleetllm:kv_transfer_seconds", "Time to ship (sent: from the frame's completion "
                                 "to the decode worker's answer) or verify and import (received) one KV frame.",
                                 ["direction"], buckets=_SECONDS, registry=r)
        self.blocks = Counter("fleetllm:kv_transfer_blocks", "KV blocks sent, imported, or already cached on arrival.",
                              ["kind"], registry=r)
        self.failures = Counter("fleetllm:kv_transfer_failures", "Failed transfers by reason.", ["reason"], registry=r)
        self.prefill_seconds = Histogram("fleetllm:pd_prefill_seconds", "Remote-prefill time on this worker, until "
                                         "its KV frame is complete.", buckets=_SECONDS, registry=r)


def frame_body_cap(engine: LLMEngine) -> int:
    """The largest KV frame worth reading (``POST /pd/kv``): the whole KV pool in fp32, its header included."""
    cfg, tokens = engine.loaded.config, engine.pool.num_blocks * engine.pool.block_size
    return tokens * (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 + 8) + engine.pool.num_blocks * 24


def pd_routes(worker: Worker, options: TransferOptions | None = None) -> list[Route]:
    """The ``/pd/prefill`` and ``/pd/kv`` routes of ``worker``."""
    ep = PDEndpoints(worker, options)
    return [Route("/pd/prefill", ep.prefill, methods=["POST"]), Route("/pd/kv", ep.receive, methods=["POST"])]


class PDEndpoints:
    """The two disaggregation endpoints of one worker, built on its public request helpers."""

    def __init__(self, worker: Worker, options: TransferOptions | None = None) -> None:
        self.worker = worker
        self.options = options or TransferOptions()
        self._metrics: TransferMetrics | None = None
        self._buffers: FrameBuffers | None = None
        self._mappings: Mappings | None = None
        self._http: httpx.AsyncClient | None = None  # to decode workers; one for all transfers (making one costs ~25 ms)

    @property
    def metrics(self) -> TransferMetrics:
        # registered on first use: a worker that never transfers shows no transfer series
        if self._metrics is None:
            self._metrics = TransferMetrics(self.worker)
        return self._metrics

    @property
    def mappings(self) -> Mappings:
        """The decode side's mappings of shared-memory frame files (made on first use)."""
        if self._mappings is None:
            from fleetllm.disagg.arrival import Mappings

            self._mappings = Mappings()
        return self._mappings

    @property
    def buffers(self) -> FrameBuffers:
        if self._buffers is None:
            self._buffers = FrameBuffers(SHM_DIR)
        return self._buffers

    # ---- prefill side ----------------------------------------------------------------------------------
    async def prefill(self, request: Request) -> Response:
        """Compute the prompt's KV into a frame, ship it to the decode worker, answer what was shipped."""
        req = await self.worker.request_body(request)
        path, body, decode_url = req.get("path", ""), req.get("body"), req.get("decode_url")
        if not isinstance(body, dict) or not isinstance(decode_url, str):
            raise APIError(400, "give body (the request) and decode_url")
        kind = "chat" if path.endswith("/chat/completions") else "text"
        ids = self.worker.prompt_ids(kind, body)[0]
        rid = f"pd-{req.get('request_id') or uuid.uuid4().hex}"
        via, timeout = req.get("transfer") or "http", float(req.get("timeout_s") or 60.0)
        t0 = time.perf_counter()
        buf, stream, sealed = await self._stream(rid, ids, via)
        shipped = False
        try:
            # sent while the prefill computes: each layer as soon as it is sealed
            sending = asyncio.create_task(self._send(stream.frame, buf, decode_url, sealed, timeout))
            try:
                await self.worker.until_disconnect(request, self._compute(rid, ids, stream))  # the router gave up: abort
                prefill_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                r = await sending
            finally:
                if not sending.done():
                    sending.cancel()
            shipped = True
        finally:
            await self.worker.async_engine.call(lambda e: e.observe_layers(rid, None))
            stream.close()
            self.buffers.give_back(buf, reusable=shipped)
        transfer_s = time.perf_counter() - t1
        n = stream.frame.size
        self.metrics.prefill_seconds.observe(prefill_s)
        self.metrics.bytes.labels(direction="sent", via=via).inc(n)
        self.metrics.seconds.labels(direction="sent").observe(transfer_s)
        self.metrics.blocks.labels(kind="sent").inc(stream.frame.header.num_blocks)
        return JSONResponse({"blocks": stream.frame.header.num_blocks, "bytes": n, "prompt_tokens": len(ids),
                             "prefill_s": prefill_s, "transfer_s": transfer_s, "via": via, **r.json()})

    async def _stream(self, rid: str, ids: list[int], via: str) -> tuple[Buffer, LayerStream, asyncio.Queue[int]]:
        """A frame buffer for ``ids``' full blocks, filled by the forward passes of request ``rid`` from now on;
        and the queue of the frame's layers as they are sealed (the trailer: ``num_layers``)."""
        from fleetllm.disagg.frame import FrameBuffer
        from fleetllm.disagg.kv_io import frame_header
        from fleetllm.disagg.layer_stream import LayerStream
        from fleetllm.engine.block_pool import hash_prefix_blocks

        engine = self.worker.engine
        hashes = hash_prefix_blocks(ids, engine.pool.block_size, engine.kv.extra_key)
        dtype = self.options.kv_transfer_dtype
        header = frame_header(engine, ids, hashes, None if dtype == "auto" else dtype)
        buf = await asyncio.to_thread(self.buffers.take, via, header.frame_bytes())
        loop, sealed = asyncio.get_running_loop(), asyncio.Queue()
        stream = LayerStream(FrameBuffer(header, buf.memory), lambda i: loop.call_soon_threadsafe(sealed.put_nowait, i))
        await self.worker.async_engine.call(lambda e: e.observe_layers(rid, stream))
        return buf, stream, sealed

    async def _compute(self, rid: str, ids: list[int], stream: LayerStream) -> None:
        # one greedy token: every layer of the prompt's blocks then went through the stream
        async for _ in self.worker.async_engine.generate(rid, ids, SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        if not stream.final:
            raise APIError(500, "the prefill ended before its KV was complete")
        await asyncio.wrap_future(stream.done)  # the last layer sealed: the frame is complete

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            import httpx  # only a prefill worker sends; httpx (with its CLI's rich/click) stays out of every start

            secret = worker_secret()  # a fleet with keys: the decode worker takes requests from its fleet only
            self._http = httpx.AsyncClient(headers={"authorization": f"Bearer {secret}"} if secret else None,
                                           limits=httpx.Limits(max_keepalive_connections=8))
        return self._http

    async def _send(self, f: FrameBuffer, buf: Buffer, decode_url: str, sealed: asyncio.Queue[int],
                    timeout: float) -> httpx.Response:
        """POST the frame to the decode worker's ``/pd/kv``, each layer as soon as it is sealed: its bytes (HTTP),
        or one byte saying so (shared memory: the decode worker maps the file being filled)."""
        import httpx

        from fleetllm.disagg.arrival import SHM_STREAM

        shm = buf.path is not None

        async def pieces() -> AsyncIterator[bytes]:
            if shm:
                yield json.dumps({"shm": str(buf.path), "bytes": f.size, "keep": True}).encode() + b"\n"
            else:
                yield f.head_piece()
            for i in range(f.header.num_layers + 1):
                await sealed.get()
                yield b"\x01" if shm else f.layer_piece(i) if i < f.header.num_layers else f.trailer_piece()

        try:
            r = await self._client().post(decode_url + "/pd/kv", content=pieces(),
                                          headers={"content-type": SHM_STREAM if shm else "application/octet-stream"},
                                          timeout=httpx.Timeout(timeout, connect=3.0))
        except httpx.HTTPError as e:
            self.metrics.failures.labels(reason="send").inc()
            raise APIError(502, f"KV transfer to {decode_url} failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            self.metrics.failures.labels(reason=f"rejected_{r.status_code}").inc()
            raise APIError(502, f"the decode worker refused the KV frame ({r.status_code}): {r.text[:200]}")
        return r

    # ---- decode side -----------------------------------------------------------------------------------
    async def receive(self, request: Request) -> Response:
        """Verify a frame and import its blocks into this worker's prefix cache, each layer as soon as it is in."""
        from fleetllm.disagg.frame import FrameError

        t0 = time.perf_counter()
        arrival = await self._arrival(request)
        try:
            # shielded: a client gone mid-import must not leave pool blocks reserved or half written
            result, nbytes = await asyncio.shield(asyncio.ensure_future(self._import(arrival)))
        except FrameError as e:
            self.metrics.failures.labels(reason="bad_frame").inc()
            raise APIError(400, f"bad KV frame: {e}") from None
        except (OSError, ValueError) as e:  # the shared-memory file named could not be mapped
            self.metrics.failures.labels(reason="shm_read").inc()
            raise APIError(400, f"cannot read the frame: {e}", "shm") from None
        self.metrics.bytes.labels(direction="received", via=arrival.via).inc(nbytes)
        self.metrics.seconds.labels(direction="received").observe(time.perf_counter() - t0)
        self.metrics.blocks.labels(kind="imported").inc(result["imported"])
        self.metrics.blocks.labels(kind="already_cached").inc(result["already_cached"])
        return JSONResponse(result)

    async def _import(self, arrival: Any) -> tuple[dict[str, int], int]:
        """The layers in so far verified (CRC) and copied into reserved pool blocks, then those that arrive next
        (a worker thread: the engine's steps go on), then the blocks committed; a failure cancels: nothing
        imported, nothing held."""
        from fleetllm.disagg.frame import FrameReader
        from fleetllm.disagg.kv_io import cancel, check_fits, commit, reserve

        reader = FrameReader(await arrival.head())
        check_fits(self.worker.engine, reader.header)  # refused before its layers are read
        engine, views, res = self.worker.async_engine, self.worker.engine.kv_blocks(), None
        n, i = reader.header.num_layers, 0
        try:
            while i < n:
                await arrival.until(i, reader.end_of(i))
                j = i + 1  # and every later layer already in: one hand-over to the thread for all of them
                while j < n and arrival.has(j, reader.end_of(j)):
                    j += 1
                if res is None:  # blocks held from the first layer on, not while the prefill computes
                    res = await engine.call(lambda e: reserve(e, reader.header))
                await asyncio.to_thread(_into_pool, reader, range(i, j), views, res)
                i = j
            await arrival.until(n, reader.size)
            await arrival.end(reader.size)
            reader.finish()
            if res is None:
                res = await engine.call(lambda e: reserve(e, reader.header))
        except BaseException:
            if res is not None:
                await engine.call(lambda e: cancel(e, res))
            raise
        return await engine.call(lambda e: commit(e, res)), reader.size

    async def _arrival(self, request: Request) -> Any:
        """Where the frame's bytes come from: the body, or the shared-memory file it names (whole, or being filled)."""
        from fleetllm.disagg.arrival import SHM_STREAM, Notified, Streamed, Whole

        ctype = request.headers.get("content-type", "")
        if ctype.startswith(SHM_STREAM):
            return Notified(request.stream(), _check_shm, self.mappings)
        if not ctype.startswith("application/json"):
            return Streamed(request.stream())
        spec = await self.worker.request_body(request)
        p = Path(str(spec.get("shm", "")))
        _check_shm(p)
        try:
            return Whole(await asyncio.to_thread(self.mappings.map, p, spec.get("bytes"), bool(spec.get("keep"))), "shm")
        except (OSError, ValueError) as e:
            self.metrics.failures.labels(reason="shm_read").inc()
            raise APIError(400, f"cannot read {p}: {e}", "shm") from None
        finally:
            if not spec.get("keep"):  # handed over: the file is ours to remove
                p.unlink(missing_ok=True)


def _check_shm(p: Path) -> None:
    if p.parent != SHM_DIR or not p.name.startswith(PREFIX):
        raise APIError(400, f"shm must name a {PREFIX}* file in the shared-memory directory", "shm")


def _into_pool(reader: Any, layers: range, views: Any, res: Any) -> None:
    from fleetllm.disagg.kv_io import write

    for i in layers:  # each layer verified, then copied while its bytes are still in the CPU's cache
        write([views[i]], [reader.layer(i)], res)
