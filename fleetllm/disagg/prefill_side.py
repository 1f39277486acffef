"""The prefill side of disaggregation: ``POST /pd/prefill`` (any role; the router sends it to prefill workers)::

    {"path": "/v1/chat/completions", "body": {...the client's request...}, "decode_url": "http://...",
     "transfer": "shm" | "http", "request_id": "...", "timeout_s": 120, "transfer_id": "..."}

computes the whole prompt's KV, samples its first token with the request's own parameters (what the
colocated path's last prefill chunk would sample) and hands both over to the decode worker, which streams
that token at once and decodes on from it (:mod:`.handoffs`, :mod:`fleetllm.engine.handoff`). After each
decoder layer the blocks it has just written, the partial last one included, are copied straight from this
worker's pool (:mod:`.layer_stream`) into one of:

- **the decode worker's own pool** (``transfer: shm`` and the decode worker shares its pool, :mod:`.direct`):
  blocks reserved there (``POST /pd/reserve``; a prompt longer than one step's token budget computes its first
  chunk meanwhile, untapped, and the next step writes the blocks computed so far), committed when the prefill
  is done (``POST /pd/commit``); nothing is copied or checked after the last layer;
- **a frame** in a mapped file in /dev/shm (``shm``, when the decode worker does not share its pool or refuses
  the reservation), the POST body to ``/pd/kv`` naming the file and then one byte per layer sealed (CRC);
- **a frame streamed over HTTP** (``http``, another host), each layer sent as soon as it is sealed.

The first token goes with the commit (direct write) or in ``POST /pd/first`` after the frame. A request of
several prompts or choices hands nothing over: only the full blocks the decode worker will take from its
cache are computed then (:func:`prefilled_tokens`). It answers ``{"blocks", "bytes", "prefill_s",
"transfer_s", "via", "handoff", ...}`` or an error status (502: the decode worker failed or refused):
``prefill_s`` runs until the first token is sampled, ``transfer_s`` from then to the decode worker's answer
(what the overlap left exposed); ``handoff`` (absent when nothing was handed over) is the id the request is
forwarded with (header :data:`.handoffs.HEADER`). ``transfer_id`` (the router's, optional) names the
transfer to the decode worker: the handoff is held under it, and a request already waiting there for it (the
router forwards it while this runs) takes it at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleetllm.disagg.buffers import Buffer, FrameBuffers
from fleetllm.disagg.config import TransferOptions
from fleetllm.disagg.handoffs import transfer_id
from fleetllm.disagg.routes import SHM_DIR, LazyMetrics, TransferMetrics
from fleetllm.engine.outputs import RequestOutput
from fleetllm.engine.params import SamplingParams
from fleetllm.server.limits import number
from fleetllm.server.protocol import MAX_TIMEOUT_S, APIError

if TYPE_CHECKING:
    import httpx

    from fleetllm.disagg.connector import PDConnector
    from fleetllm.disagg.direct import DirectLeg
    from fleetllm.disagg.frame import FrameBuffer
    from fleetllm.disagg.layer_stream import LayerStream
    from fleetllm.disagg.shared_pool import PoolMaps
    from fleetllm.server.app import Worker


class PrefillEndpoints:
    """``POST /pd/prefill`` of one worker, built on its public request helpers."""

    def __init__(self, worker: Worker, metrics: LazyMetrics, connector: PDConnector,
                 options: TransferOptions | None = None) -> None:
        """``connector``: the worker's engine's, through which the prefill's KV streams out."""
        self.worker = worker
        self.connector = connector
        self.options = options or TransferOptions()
        self._metrics = metrics
        self._buffers: FrameBuffers | None = None
        self._pool_maps: PoolMaps | None = None  # decode workers' shared pools, mapped
        self._http: httpx.AsyncClient | None = None  # to decode workers; one for all transfers (making one costs ~25 ms)

    @property
    def metrics(self) -> TransferMetrics:
        return self._metrics.get()

    @property
    def _in_place(self) -> bool:
        """Whether a direct write computes in the decode worker's blocks themselves (no copy): on a prefill
        worker, whose steps are all prefills (it takes steps of its own: a worker's decoding requests would
        stall for the prefill's length), computing on the CPU (the mapped pool is host memory)."""
        return self.worker.role == "prefill" and self.worker.engine.executor.device == "cpu"

    @property
    def buffers(self) -> FrameBuffers:
        if self._buffers is None:
            self._buffers = FrameBuffers(SHM_DIR)
        return self._buffers

    @property
    def pool_maps(self) -> PoolMaps:
        if self._pool_maps is None:
            from fleetllm.disagg.shared_pool import PoolMaps

            self._pool_maps = PoolMaps()
        return self._pool_maps

    async def prefill(self, request: Request) -> Response:
        """Compute the prompt's KV into the decode worker's pool (same host, pool shared) or a frame shipped to
        it, and its first token; answer what was shipped."""
        req = await self.worker.request_body(request)
        path, body, decode_url = req.get("path", ""), req.get("body"), peer_url(req.get("decode_url"))
        if not isinstance(body, dict):
            raise APIError(400, "give body (the request) and decode_url")
        lora = self.worker.lora_for(body.get("model"))  # an adapter's request computes its KV with the adapter
        job = await self._job(path, body, req.get("request_id"), transfer_id(req.get("transfer_id")), lora)
        via, timeout = req.get("transfer") or "http", number(req.get("timeout_s"), "timeout_s", 0.001, MAX_TIMEOUT_S, 60.0)
        if via == "shm":
            return await self._prefill_same_host(request, job, decode_url, timeout)
        return await self._prefill_frame(request, job, via, decode_url, timeout)

    async def _prefill_same_host(self, request: Request, job: PrefillJob, decode_url: str, timeout: float) -> Response:
        """Into the decode worker's own pool blocks if it shares its pool, else a frame in /dev/shm. A prompt
        longer than one step's token budget starts computing before the reservation is answered: the round
        trip (a decode step long when the decode worker is busy) overlaps its first chunk instead of preceding
        it."""
        t0 = time.perf_counter()
        early = None
        if len(job.ids) > self.worker.engine.config.max_num_batched_tokens:
            early = asyncio.ensure_future(self._generate(job))  # untapped until a target is attached
        try:
            leg = await self._reserve(job, decode_url, timeout)
            if leg is not None:
                return await self._prefill_direct(request, job, leg, timeout, early, t0)
            return await self._prefill_frame(request, job, "shm", decode_url, timeout, early, t0)
        finally:
            await _cancel(early)  # done by now unless something failed first: then its engine request is aborted

    async def _job(self, path: str, body: dict[str, Any], request_id: Any, transfer: str | None,
                   lora: str | None) -> PrefillJob:
        """What to compute for ``body`` with adapter ``lora`` (None: the base model): its whole prompt and first
        token when it is one sub-request (the colocated path's parameters: the first choice's seed), else the full
        blocks with one greedy token."""
        kind = "chat" if path.endswith("/chat/completions") else "text"
        prompts = await self.worker.encoded(kind, body)
        params = await self.worker.request_params(kind, body)
        rid = f"pd-{request_id or ''}-{uuid.uuid4().hex[:12]}"  # unique: a client may reuse its request id
        if len(prompts) == 1 and params.n == 1:
            return PrefillJob(rid, prompts[0], replace(params.for_choice(0), max_tokens=1), True, transfer, lora)
        ids = prefilled_tokens(prompts[0], self.connector.blocks.pool.block_size)
        return PrefillJob(rid, ids, SamplingParams(max_tokens=1, temperature=0.0), False, transfer, lora)

    async def _prefill_frame(self, request: Request, job: PrefillJob, via: str, decode_url: str, timeout: float,
                             early: asyncio.Future[RequestOutput] | None = None, t0: float | None = None) -> Response:
        t0 = time.perf_counter() if t0 is None else t0
        buf, frame, stream, sealed = await self._stream(job, via)
        shipped = False
        try:
            # sent while the prefill computes: each layer as soon as it is sealed
            sending = asyncio.create_task(self._send(frame, buf, decode_url, sealed, timeout, job))
            try:
                computing = await self._tap(job, stream, early)
                out = await self.worker.until_disconnect(request, self._finish(computing, stream))  # gave up: abort
                prefill_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                result = (await sending).json()
            finally:
                if not sending.done():
                    sending.cancel()
            shipped = True
        finally:
            await self._untap(job)
            stream.close()
            self.buffers.give_back(buf, reusable=shipped)
        if job.handoff and "handoff" in result:
            await self._give_first(decode_url, result["handoff"], out, timeout)
        return self._shipped(via, frame.header.num_blocks, frame.size, len(job.ids), prefill_s,
                             time.perf_counter() - t1, result)

    async def _give_first(self, decode_url: str, handoff: str, out: RequestOutput, timeout: float) -> None:
        """Send the first token of the handoff a frame made on the decode worker (``POST /pd/first``)."""
        await self._post_decode(decode_url, "/pd/first", "first token", "the first token",
                                json={"handoff": handoff, "first": first_of(out)}, timeout=timeout)

    async def _post_decode(self, decode_url: str, path: str, what: str, refused: str, **kw: Any) -> Any:
        """POST ``path`` to the decode worker; a transport error or a refusal is a 502, counted by reason."""
        import httpx

        try:
            r = await self._client().post(decode_url + path, **kw)
        except httpx.HTTPError as e:
            self.metrics.failures.labels(reason="send").inc()
            raise APIError(502, f"{what} to {decode_url} failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            self.metrics.failures.labels(reason=f"rejected_{r.status_code}").inc()
            raise APIError(502, f"the decode worker refused {refused} ({r.status_code}): {r.text[:200]}")
        return r

    def _shipped(self, via: str, blocks: int, nbytes: int, prompt_tokens: int, prefill_s: float, transfer_s: float,
                 result: dict[str, Any], **extra: float | bool) -> JSONResponse:
        self.metrics.prefill_seconds.observe(prefill_s)
        self.metrics.bytes.labels(direction="sent", via=via).inc(nbytes)
        self.metrics.seconds.labels(direction="sent").observe(transfer_s)
        self.metrics.blocks.labels(kind="sent").inc(blocks)
        return JSONResponse({"blocks": blocks, "bytes": nbytes, "prompt_tokens": prompt_tokens, "prefill_s": prefill_s,
                             "transfer_s": transfer_s, "via": via, **extra, **result})

    async def _reserve(self, job: PrefillJob, decode_url: str, timeout: float) -> DirectLeg | None:
        """Blocks reserved in the decode worker's shared pool for the job's KV; None: it takes frames only."""
        import httpx

        from fleetllm.disagg import direct
        from fleetllm.disagg.kv_io import frame_header
        from fleetllm.engine.block_pool import hash_prefix_blocks

        engine = self.connector.blocks
        hashes = hash_prefix_blocks(job.ids, engine.pool.block_size, engine.kv.key_of(job.lora_name))
        header = frame_header(engine, job.ids, hashes, tail=job.handoff, lora_name=job.lora_name)
        try:
            leg = await direct.reserve(self._client(), decode_url, header, self.pool_maps, timeout, self._in_place)
        except httpx.HTTPError as e:
            self.metrics.failures.labels(reason="send").inc()
            raise APIError(502, f"KV transfer to {decode_url} failed: {type(e).__name__}: {e}") from None
        if leg is None:
            self.metrics.failures.labels(reason="reserve_refused").inc()  # frames, as before
        return leg

    async def _prefill_direct(self, request: Request, job: PrefillJob, leg: DirectLeg, timeout: float,
                              early: asyncio.Future[RequestOutput] | None, t0: float) -> Response:
        """The prefill writes each layer into the reserved pool blocks as it computes; then commit them (with
        the first token: handed over). ``early``: the prefill, started before the reservation was answered."""
        import httpx

        from fleetllm.disagg import direct
        from fleetllm.disagg.frame import FrameError
        from fleetllm.disagg.layer_stream import LayerStream

        t0 = t0 if early is not None else time.perf_counter()
        stream = LayerStream(leg.target, in_place=self._in_place and leg.target.whole)
        committed = False
        try:
            computing = await self._tap(job, stream, early)
            out = await self.worker.until_disconnect(request, self._finish(computing, stream))
            prefill_s, t1, committed_at = time.perf_counter() - t0, time.perf_counter(), time.monotonic()
            result = await direct.commit(self._client(), leg, timeout, first_of(out) if job.handoff else None,
                                         job.transfer, keep=stream.in_place)
            committed, transfer_s = True, time.perf_counter() - t1
        except (FrameError, APIError) as e:  # the lease ended before the last layer was written
            if isinstance(e, APIError) and not leg.target.missed:  # (in place: the step writing past it failed)
                raise
            self.metrics.failures.labels(reason="lease_lost").inc()
            raise APIError(502, f"KV write into {leg.url}'s pool abandoned: {e}") from None
        except (httpx.HTTPError, ValueError) as e:
            self.metrics.failures.labels(reason="commit").inc()
            self.pool_maps.forget(leg.layout.path)
            raise APIError(502, f"KV commit on {leg.url} failed: {type(e).__name__}: {e}") from None
        finally:  # no write once the observer is off (between steps); then the blocks go back unless committed
            await self._untap(job)
            leg.target.close()
            stream.close()
            if not committed:
                await asyncio.shield(direct.release(self._client(), leg.url, leg.lease))
        read_back_s = await self._read_back(leg, committed_at) if result.get("kept") else 0.0
        return self._shipped("pool", leg.target.header.num_blocks, leg.target.nbytes, len(job.ids), prefill_s,
                             transfer_s, result, reserve_s=leg.reserve_s, reserved_during_prefill=computing is early,
                             in_place=stream.in_place, read_back_s=read_back_s)

    async def _read_back(self, leg: DirectLeg, committed_at: float) -> float:
        """A prompt computed in place: its full blocks copied from the decode worker's pool into this worker's
        prefix cache (:func:`.direct.read_back`; the decode worker already streams), then the lease released;
        seconds it took. A failure costs the prefix cache here that prompt, nothing else: counted, not raised."""
        from fleetllm.disagg import direct

        t = time.perf_counter()
        try:
            await direct.read_back(self.connector.blocks, leg, committed_at)
        except Exception:  # noqa: BLE001 - the request is served; only this worker's cache misses the prompt
            self.metrics.failures.labels(reason="read_back").inc()
        finally:
            await asyncio.shield(direct.release(self._client(), leg.url, leg.lease))
        return time.perf_counter() - t

    async def _stream(self, job: PrefillJob, via: str) -> tuple[Buffer, FrameBuffer, LayerStream, asyncio.Queue[int]]:
        """A frame buffer for the job's blocks, filled by its forward passes from now on; and the queue of the
        frame's layers as they are sealed (the trailer: ``num_layers``)."""
        from fleetllm.disagg.frame import FrameBuffer
        from fleetllm.disagg.kv_io import frame_header
        from fleetllm.disagg.layer_stream import LayerStream
        from fleetllm.engine.block_pool import hash_prefix_blocks

        engine = self.connector.blocks
        hashes = hash_prefix_blocks(job.ids, engine.pool.block_size, engine.kv.key_of(job.lora_name))
        dtype = self.options.kv_transfer_dtype
        header = frame_header(engine, job.ids, hashes, None if dtype == "auto" else dtype, tail=job.handoff,
                              lora_name=job.lora_name)
        buf = await asyncio.to_thread(self.buffers.take, via, header.frame_bytes())
        loop, sealed = asyncio.get_running_loop(), asyncio.Queue()
        frame = FrameBuffer(header, buf.memory)
        stream = LayerStream(frame, lambda i: loop.call_soon_threadsafe(sealed.put_nowait, i))
        return buf, frame, stream, sealed

    async def _tap(self, job: PrefillJob, stream: LayerStream,
                   early: asyncio.Future[RequestOutput] | None) -> asyncio.Future[RequestOutput]:
        """The job's prefill, with ``stream`` shown every block of it: ``early`` (started untapped) while the step
        completing its prompt is still to come (the stream's first step writes the blocks computed before it),
        else a prefill started now (``early``'s full blocks are prefix hits here: its last block is computed
        again, and its first token sampled again from the same state)."""
        c = self.connector
        if await c.blocks.run(c.attach, job.rid, stream, early is not None) and early is not None:
            return early
        if early is not None:
            await _cancel(early)
            await c.blocks.run(c.observe, job.rid, stream)
        return asyncio.ensure_future(self._generate(job))

    async def _untap(self, job: PrefillJob) -> None:
        """Take the job's stream off the engine (between steps: no write follows)."""
        await self.connector.blocks.run(self.connector.observe, job.rid, None)

    async def _generate(self, job: PrefillJob) -> RequestOutput:
        """The job's prefill and its one sampled token (the final output)."""
        outs = [o async for o in self.worker.async_engine.generate(job.rid, job.ids, job.params, exact=True,
                                                                 lora_name=job.lora_name)]
        out = outs[-1] if outs else None
        if out is None or out.error or not out.new_token_ids:
            raise APIError(500, f"the prefill ended before its KV was complete{f': {out.error}' if out else ''}")
        return out

    async def _finish(self, computing: asyncio.Future[RequestOutput], stream: LayerStream) -> RequestOutput:
        """``computing``'s output once ``stream`` holds the whole prompt (cancelled: so is ``computing``)."""
        out = await computing
        if not stream.final:
            raise APIError(500, "the prefill ended before its KV was complete")
        await asyncio.wrap_future(stream.done)  # the last layer sealed: the frame is complete
        return out

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            import httpx  # only a prefill worker sends; httpx (with its CLI's rich/click) stays out of every start

            secret = self.worker.secret  # the decode worker takes requests from its fleet only
            self._http = httpx.AsyncClient(headers={"authorization": f"Bearer {secret}"} if secret else None,
                                           limits=httpx.Limits(max_keepalive_connections=8))
        return self._http

    async def _send(self, f: FrameBuffer, buf: Buffer, decode_url: str, sealed: asyncio.Queue[int],
                    timeout: float, job: PrefillJob) -> httpx.Response:
        """POST the frame to the decode worker's ``/pd/kv``, each layer as soon as it is sealed: its bytes (HTTP),
        or one byte saying so (shared memory: the decode worker maps the file being filled); for ``job``'s
        transfer, and (a handoff) the whole prompt for the decode worker to hold for its request."""
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

        query = {**({"handoff": "1"} if job.handoff else {}), **({"transfer_id": job.transfer} if job.transfer else {})}
        return await self._post_decode(
            decode_url, "/pd/kv", "KV transfer", "the KV frame", params=query, content=pieces(),
            headers={"content-type": SHM_STREAM if shm else "application/octet-stream"},
            timeout=httpx.Timeout(timeout, connect=3.0))


@dataclass
class PrefillJob:
    """One remote prefill: the tokens to compute, how to sample the one token, whether to hand both over."""

    rid: str  # the engine id of its request here (exact: its KV connector finds it by it)
    ids: list[int]
    params: SamplingParams
    handoff: bool  # the whole prompt and its first token, for the decode worker to go on from
    transfer: str | None = None  # the router's id of the transfer, if it named one
    lora_name: str | None = None  # the adapter the prompt runs with (None: the base model)


async def _cancel(task: asyncio.Future[Any] | None) -> None:
    """Stop ``task`` (a prefill: its engine request is aborted) and wait for it; what it raised is dropped."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as lost


def peer_url(value: Any) -> str:
    """A decode worker's base URL as the router names its workers: ``http(s)://host[:port]`` and nothing else
    (no path, query or user), so that only the ``/pd/*`` endpoints below it are ever called; 400 otherwise.
    Who may name one at all is settled before: ``/pd/*`` takes the fleet's secret only."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(value) if isinstance(value, str) else None
        _ = u.port if u is not None else None  # a port out of range raises
    except ValueError:
        u = None
    if (u is None or u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query
            or u.fragment or u.username or u.password):
        raise APIError(400, "decode_url must be a worker's base URL: http(s)://host[:port]", "decode_url")
    return value.rstrip("/")


def first_of(out: RequestOutput) -> dict[str, Any]:
    """The first token of a prefill's final output, as the decode worker takes it over."""
    from fleetllm.disagg.handoffs import first_token_json

    return first_token_json(out.new_token_ids[0], out.logprobs[0] if out.logprobs else None, out.sampler_state)


def prefilled_tokens(ids: list[int], block_size: int) -> list[int]:
    """The tokens of ``ids`` worth prefilling here when nothing is handed over (a request of several prompts or
    choices): the full blocks the decode worker will take from its cache.

    It always computes the prompt's last token (its logits), so it takes the full blocks of all tokens but
    the last and recomputes the rest (a 2048-token prompt: 127 blocks, then 16 tokens); prefilling more here
    would be computed twice and shipped for nothing. A prompt shorter than that is prefilled whole."""
    n = (len(ids) - 1) // block_size
    return ids[: n * block_size] if n else ids
