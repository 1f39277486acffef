"""The decode side of disaggregation: a prompt's KV blocks arriving from a prefill worker.

``POST /pd/kv`` takes a frame (``application/octet-stream``), a shared-memory file being filled
(:data:`.arrival.SHM_STREAM`), or a finished one (``{"shm": path, "bytes": n, "keep": bool}``; without keep
the receiver unlinks it). Each layer is verified (CRC) as soon as it is in and copied from the frame's bytes
straight into pool blocks reserved for it, off the engine thread (see :mod:`.kv_io`); the blocks are
registered only once the trailer checks out. A bad frame is a 400 and imports nothing.

``POST /pd/reserve`` ``{"header": {...frame header...}, "lease_s", "pid", "pid_ns", "whole"}`` holds pool blocks
for a prefill worker on this host to write into directly (this worker's pool must be shared: else 409, and the
prefill worker sends a frame; ``whole``: a block for each of the prompt's, for a prefill computing in them) and
answers ``{"lease", "lease_s", "blocks", "pool"}``; ``POST /pd/commit``
``{"lease", "keep"}`` registers them as an import would (``keep``: and keeps them for the writer to read back
until it releases the lease), ``POST /pd/release`` frees them (:mod:`.leases`).

A prefill of the whole prompt hands it over (:mod:`.handoffs`): ``POST /pd/commit`` ``{"lease", "first"}``
(the first token sampled), or ``POST /pd/kv?handoff=1`` then ``POST /pd/first`` ``{"handoff", "first"}``,
keep every block held and answer the ``handoff`` id the request is forwarded with. Both take the router's id
for the transfer (``"transfer_id"`` in the commit, ``&transfer_id=`` on ``/pd/kv``): the handoff is then held
under it, or (a plain import) the request already waiting for it runs; ``POST /pd/abandon``
``{"transfer_id"}`` (the router: the remote leg failed) lets that request run at once with a local prefill.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleetllm.disagg.buffers import PREFIX
from fleetllm.disagg.handoffs import transfer_id
from fleetllm.disagg.routes import SHM_DIR, LazyMetrics, TransferMetrics
from fleetllm.server.limits import number
from fleetllm.server.protocol import MAX_TIMEOUT_S, APIError

if TYPE_CHECKING:
    from fleetllm.disagg.arrival import Mappings
    from fleetllm.disagg.connector import PDConnector
    from fleetllm.disagg.leases import Leases
    from fleetllm.server.app import Worker


class DecodeEndpoints:
    """The receiving endpoints of one worker, built on its public request helpers."""

    def __init__(self, worker: Worker, metrics: LazyMetrics, connector: PDConnector) -> None:
        """``connector``: the worker's engine's, whose block access every import goes through."""
        self.worker = worker
        self.blocks = connector.blocks  # the engine's pool, edited on its thread only
        self._metrics = metrics
        self._mappings: Mappings | None = None
        self._leases: Leases | None = None  # blocks reserved for direct writes

    @property
    def metrics(self) -> TransferMetrics:
        return self._metrics.get()

    @property
    def mappings(self) -> Mappings:
        """The mappings of shared-memory frame files (made on first use)."""
        if self._mappings is None:
            from fleetllm.disagg.arrival import Mappings

            self._mappings = Mappings()
        return self._mappings

    @property
    def leases(self) -> Leases:
        if self._leases is None:
            from fleetllm.disagg.leases import Leases

            self._leases = Leases(self.blocks, self.worker.handoffs)
        return self._leases

    async def reserve(self, request: Request) -> Response:
        """Hold pool blocks for a prompt's KV, for a prefill worker on this host to write into (under a lease)."""
        from fleetllm.disagg.frame import FrameError, FrameHeader
        from fleetllm.disagg.shared_pool import PoolLayout

        spec = await self.worker.request_body(request)
        lease_s = number(spec.get("lease_s"), "lease_s", 0.001, MAX_TIMEOUT_S, 60.0)  # longer: cut to MAX_LEASE_S
        pool = self.blocks.kv_pool_file()
        if pool is None:
            raise APIError(409, "this worker's KV pool is not shared: send a frame", "pool")
        try:
            header = FrameHeader.parse(spec.get("header"))
        except (ValueError, TypeError) as e:  # FrameError included
            raise APIError(400, f"cannot reserve: {e}", "header") from None
        try:
            lease = await asyncio.shield(self.leases.reserve(header, lease_s, _int_or_none(spec.get("pid")),
                                                             _int_or_none(spec.get("pid_ns")), spec.get("whole") is True))
        except FrameError as e:  # another model or layout, or hashes that do not match the tokens
            raise APIError(400, f"cannot reserve: {e}", "header") from None
        return JSONResponse({"lease": lease.id, "lease_s": lease.deadline - time.monotonic(), "blocks": lease.targets(),
                             "pool": PoolLayout.of(self.blocks, pool.path).to_json()})

    async def commit(self, request: Request) -> Response:
        """The writer is done: register the lease's blocks in the prefix cache (as an imported frame's); with the
        prompt's first token, hold them as a handoff too."""
        spec = await self.worker.request_body(request)
        first = spec.get("first") if isinstance(spec.get("first"), dict) else None
        transfer = transfer_id(spec.get("transfer_id"))
        result = await asyncio.shield(self.leases.commit(str(spec.get("lease")), first, transfer,
                                                         spec.get("keep") is True))
        if result is None:
            self.metrics.failures.labels(reason="lease_over").inc()
            raise APIError(409, "no such lease (expired or released): nothing imported", "lease")
        self.metrics.blocks.labels(kind="imported").inc(result["imported"])
        self.metrics.blocks.labels(kind="already_cached").inc(result["already_cached"])
        return JSONResponse(result)

    async def first(self, request: Request) -> Response:
        """The first token of a handoff whose KV arrived in a frame (``/pd/kv?handoff=1``)."""
        spec = await self.worker.request_body(request)
        if not isinstance(spec.get("first"), dict) or not self.worker.handoffs.give_first(str(spec.get("handoff")),
                                                                                          spec["first"]):
            raise APIError(409, "no such handoff (expired or claimed), or no first token", "handoff")
        return JSONResponse({"handoff": spec["handoff"]})

    async def abandon(self, request: Request) -> Response:
        """The router gave the transfer up (its remote leg failed): the request waiting for it runs now."""
        transfer = transfer_id((await self.worker.request_body(request)).get("transfer_id"))
        if transfer is None:
            raise APIError(400, "give the transfer's id", "transfer_id")
        self.worker.handoffs.ended(transfer)
        return JSONResponse({"transfer_id": transfer})

    async def release(self, request: Request) -> Response:
        """The writer gave up: free the lease's blocks unregistered."""
        lease = str((await self.worker.request_body(request)).get("lease"))
        return JSONResponse({"released": await asyncio.shield(self.leases.release(lease))})

    async def receive(self, request: Request) -> Response:
        """Verify a frame and import its blocks into this worker's prefix cache, each layer as soon as it is in."""
        from fleetllm.disagg.frame import FrameError

        t0 = time.perf_counter()
        transfer = transfer_id(request.query_params.get("transfer_id"))
        arrival = await self._arrival(request)
        try:
            # shielded: a client gone mid-import must not leave pool blocks reserved or half written
            hold = request.query_params.get("handoff") == "1"  # the whole prompt: held for its request
            result, nbytes = await asyncio.shield(asyncio.ensure_future(self._import(arrival, hold, transfer)))
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

    async def _import(self, arrival: Any, hold: bool, transfer: str | None) -> tuple[dict[str, Any], int]:
        """The layers in so far verified (CRC) and copied into reserved pool blocks, then those that arrive next
        (a worker thread: the engine's steps go on), then the blocks committed (``hold``: as a handoff, under
        ``transfer`` if given; else ``transfer``'s request runs now); a failure cancels: nothing imported,
        nothing held."""
        from fleetllm.disagg.frame import FrameReader
        from fleetllm.disagg.kv_io import cancel, check_fits, commit, reserve

        blocks = self.blocks
        reader = FrameReader(await arrival.head(), lambda header: check_fits(blocks, header))  # before its layers
        views, res = blocks.kv_blocks(), None
        n, i = reader.header.num_layers, 0
        try:
            while i < n:
                await arrival.until(i, reader.end_of(i))
                j = i + 1  # and every later layer already in: one hand-over to the thread for all of them
                while j < n and arrival.has(j, reader.end_of(j)):
                    j += 1
                if res is None:  # blocks held from the first layer on, not while the prefill computes
                    res = await blocks.call(reserve, reader.header)
                await asyncio.to_thread(_into_pool, reader, range(i, j), views, res)
                i = j
            await arrival.until(n, reader.size)
            await arrival.end(reader.size)
            reader.finish()
            if res is None:
                res = await blocks.call(reserve, reader.header)
        except BaseException:
            if res is not None:
                await blocks.call(cancel, res)
            raise
        if hold:
            return await self.worker.handoffs.commit(res, None, transfer), reader.size
        result = await blocks.call(commit, res)
        if transfer is not None:
            self.worker.handoffs.ended(transfer)
        return result, reader.size

    async def _arrival(self, request: Request) -> Any:
        """Where the frame's bytes come from: the body, or the shared-memory file it names (whole, or being filled)."""
        from fleetllm.disagg.arrival import SHM_STREAM, Notified, Streamed, Whole

        ctype = request.headers.get("content-type", "")
        if ctype.startswith(SHM_STREAM):
            return Notified(request.stream(), _check_shm, self.mappings)
        if not ctype.startswith("application/json"):
            from fleetllm.disagg.frame import max_head_bytes
            from fleetllm.disagg.kv_io import check_fits

            engine = self.worker.engine
            return Streamed(request.stream(), lambda header: check_fits(engine, header),
                            max_head_bytes(engine.max_model_len, engine.pool.block_size))
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


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _check_shm(p: Path) -> None:
    if p.parent != SHM_DIR or not p.name.startswith(PREFIX):
        raise APIError(400, f"shm must name a {PREFIX}* file in the shared-memory directory", "shm")


def _into_pool(reader: Any, layers: range, views: Any, res: Any) -> None:
    from fleetllm.disagg.kv_io import write

    for i in layers:  # each layer verified, then copied while its bytes are still in the CPU's cache
        write([views[i]], [reader.layer(i)], res)
