"""Drives an :class:`LLMEngine` from one background thread and streams its outputs to asyncio callers.

The engine's step loop stays plain and synchronous; adds and aborts travel to it through a command
queue and are applied between steps, so the engine is only ever touched by its own thread. Outputs
come back to the event loop with ``call_soon_threadsafe``. PyTorch releases the GIL in its kernels,
so the HTTP side stays responsive while a step runs.

Engine request ids are minted here, unique per call: a caller's id (a client's ``x-request-id``,
which clients reuse) is only a label, so two calls with the same label never share a stream.

If the engine thread itself fails (an exception outside the per-step guard: scheduling,
detokenising, updating from an output), it is dead: every waiting caller gets :class:`EngineFailed`
at once, later calls too, and ``on_failure`` runs (the worker stops taking requests and exits).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fleetllm.engine.outputs import RequestOutput
from fleetllm.engine.params import SamplingParams

if TYPE_CHECKING:
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.engine.handoff import Handoff

log = logging.getLogger(__name__)
T = TypeVar("T")
# ("stored" | "removed" | ..., block hashes, their adapters (None: none), medium (None: the pool))
KVEvent = tuple[str, list[int], "list[str | None] | None", "str | None"]


class EngineFailed(RuntimeError):
    """The engine thread died; no request can run on this engine any more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_failure = on_failure  # called on the event loop once, when the engine thread dies
        self.failure: EngineFailed | None = None
        self._cmds: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._kv_subscribers: set[asyncio.Queue[KVEvent]] = set()
        # other media the worker reports blocks in (a KV tier's medium -> the hashes it holds), read on the
        # engine thread for a subscriber's snapshot; their events come through publish_kv_event
        self.kv_media: dict[str, Callable[[], list[int]]] = {}
        self._kv_publish = False  # becomes True with the first subscriber (engine thread only)
        self.steps = 0
        self._deferred: deque[tuple[str, Any]] = deque()  # commands that came while a step was paused
        if engine.step_pause is not None:
            engine.step_pause.on_pause = self._while_paused
        engine.pool.on_event = self._on_kv_event  # called on the engine thread
        engine.blocks.runner = self._between_steps  # a KV connector's pool edits run on the engine thread

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("noop", None))
        if self._thread:
            self._thread.join(timeout=10)

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive (started and not stopped or crashed)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def generate(self, label: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None, handoff: Handoff | None = None,
                       exact: bool = False, lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; the request is aborted if the caller stops iterating early.
        ``handoff``: its prompt prefilled elsewhere (:meth:`LLMEngine.add_request`), its first token out at once.

        ``label`` names the request in the engine's id (``label#n``); it need not be unique. ``exact``: the
        engine's id is ``label`` itself (unique among live requests: a KV connector told of it finds it).
        ``lora_name``: the adapter it runs with (None: the base model; an unknown one raises ``LoraError`` 404).
        Raises :class:`EngineFailed` if the engine thread is dead or dies meanwhile."""
        assert self._loop is not None, "start() the engine first"
        if self.failure is not None:
            raise self.failure
        request_id = label if exact else f"{label}#{next(self._ids)}"
        added: asyncio.Future[None] = self._loop.create_future()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        # the request arrives now, not when the engine thread next takes commands (after a running step)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._cmds.put(("add", (request_id, prompt_token_ids, params, arrival, handoff, lora_name, added)))
        if self.engine.step_pause is not None and handoff is None:
            self.engine.step_pause.ask(params.priority)  # the step in flight may pause for its first token
        finished = False
        try:
            await added  # raises the engine's validation error (bad params, too long, queue full)
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    finished = isinstance(out, EngineFailed)  # a dead engine has nothing to abort
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._cmds.put(("abort", request_id))

    async def subscribe_kv_events(self) -> tuple[asyncio.Queue[KVEvent], list[int], dict[str, list[int]]]:
        """A queue of ("stored" | "removed", block hashes, each stored block's adapter or None when all are the
        base model's, medium: None for the pool) events, the snapshot of cached hashes they follow, and the
        hashes each of :attr:`kv_media` holds. The snapshot is taken on the engine thread between steps, and
        the queue is registered in the same FIFO as event deliveries, so snapshot + events is exactly the
        cache's state (a medium written from another thread may have an event cross its snapshot). Call
        :meth:`unsubscribe_kv_events` when done."""
        assert self._loop is not None, "start() the engine first"
        if self.failure is not None:
            raise self.failure
        q: asyncio.Queue[KVEvent] = asyncio.Queue()
        fut: asyncio.Future[tuple[list[int], dict[str, list[int]]]] = self._loop.create_future()
        self._cmds.put(("kv_snapshot", (q, fut)))
        pool, media = await fut
        return q, pool, media

    def publish_kv_event(self, kind: str, hashes: list[int], medium: str) -> None:
        """Send ("stored" | "removed", ``hashes``, ``medium``) to every KV-event subscriber: a block entered or
        left a medium of :attr:`kv_media`. From any thread."""
        if self._kv_publish and self._loop is not None:
            self._loop.call_soon_threadsafe(self._fanout_kv, kind, list(hashes), None, medium)

    async def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` as ``name``: read and checked on a worker thread (steps go on), then
        registered between steps. Raises :class:`fleetllm.lora.errors.LoraError` (400/404) with nothing loaded."""
        manager = self.engine.lora
        adapter = await asyncio.to_thread(manager.read, path) if manager is not None else None
        await self.call(lambda engine: engine.load_lora(name, path, adapter))

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` between steps (``LoraError`` 404 when it is not loaded)."""
        await self.call(lambda engine: engine.unload_lora(name))

    async def _between_steps(self, thunk: Callable[[], T]) -> T:
        return await self.call(lambda _engine: thunk())

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or raise its error).

        For work that must see a consistent engine (exporting or importing KV blocks)."""
        assert self._loop is not None, "start() the engine first"
        if self.failure is not None:
            raise self.failure
        fut: asyncio.Future[T] = self._loop.create_future()
        self._cmds.put(("call", (fn, fut)))
        return await fut

    def unsubscribe_kv_events(self, q: asyncio.Queue[KVEvent]) -> None:
        self._kv_subscribers.discard(q)

    def announce(self, kind: str) -> int:
        """Send a ``kind`` event (no hashes) to every KV-event subscriber now; return how many there are.
        On the event loop (e.g. "draining", which routers act on at once)."""
        self._fanout_kv(kind, [])
        return len(self._kv_subscribers)

    # ---- engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_steps()
        except BaseException as e:  # noqa: BLE001 - the thread dies; every caller must hear of it
            log.exception("engine thread failed; failing every request")
            self._loop.call_soon_threadsafe(self._fail_all, EngineFailed(f"engine failed: {type(e).__name__}: {e}"))

    def _loop_steps(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            while self._deferred:
                self._apply(self._deferred.popleft())
            try:
                block = not eng.has_unfinished()
                cmd = self._cmds.get(block=block, timeout=0.5 if block else None) if block else self._cmds.get_nowait()
                self._apply(cmd)
                while True:
                    self._apply(self._cmds.get_nowait())
            except queue.Empty:
                pass
            outs = eng.take_outputs()  # a handed-over first token goes out now, not after the next step
            if outs:
                self._loop.call_soon_threadsafe(self._deliver, outs)
            if self._stop.is_set():
                break
            if eng.has_unfinished():
                outs = eng.step()
                self.steps += 1
                if outs:
                    self._loop.call_soon_threadsafe(self._deliver, outs)

    def _while_paused(self) -> None:
        """A step paused between layers for an urgent arrival (engine thread, :mod:`fleetllm.engine.step_pause`):
        queue the requests that arrived, compute the urgent ones' prompts in a step of their own, and hand out
        their first tokens now. Any other command waits for the step's end (an abort would free blocks the
        paused step's rows write; a handed-over prefill would start running), and so does every command after
        it (in order: an adapter loaded, then asked for)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            kind, arg = cmd
            handoff = arg[4] if kind == "add" else None
            if kind == "add" and handoff is None and not self._deferred:
                self._apply(cmd)
            else:
                self._deferred.append(cmd)
        outs = self.engine.urgent_step()
        if outs:
            self._loop.call_soon_threadsafe(self._deliver, outs)

    def _apply(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            rid, ids, params, arrival, handoff, lora_name, fut = arg
            try:
                self.engine.add_request(rid, ids, params, arrival, handoff, lora_name)
                err = None
            except Exception as e:  # validation errors go back to the caller, the loop goes on
                err = e
            self._loop.call_soon_threadsafe(_resolve, fut, None, err)
        elif kind == "abort":
            self.engine.abort_request(arg)
        elif kind == "call":
            fn, fut = arg
            try:
                result, err = fn(self.engine), None
            except Exception as e:  # returned to the caller; the loop goes on
                result, err = None, e
            self._loop.call_soon_threadsafe(_resolve, fut, result, err)
        elif kind == "kv_snapshot":
            q, fut = arg
            self._kv_publish = True  # set on this thread before the snapshot: no event can slip between
            media = {m: held() for m, held in self.kv_media.items()}
            self._loop.call_soon_threadsafe(self._register_kv, q, fut, (list(self.engine.pool.cached), media))

    def _on_kv_event(self, kind: str, hashes: list[int]) -> None:
        if self._kv_publish and self._loop is not None:
            self._loop.call_soon_threadsafe(self._fanout_kv, kind, list(hashes), self._lora_names(kind, hashes))

    def _lora_names(self, kind: str, hashes: list[int]) -> list[str | None] | None:
        """Engine thread: the adapter of each block just stored (None when every one is the base model's)."""
        if kind != "stored" or self.engine.lora is None:
            return None
        pool = self.engine.pool
        names = [pool.blocks[pool.cached[h]].lora_name if h in pool.cached else None for h in hashes]
        return names if any(names) else None

    def _register_kv(self, q: asyncio.Queue[KVEvent], fut: asyncio.Future[Any], snapshot: Any) -> None:
        self._kv_subscribers.add(q)
        if not fut.done():
            fut.set_result(snapshot)

    def _fanout_kv(self, kind: str, hashes: list[int], lora_names: list[str | None] | None = None,
                   medium: str | None = None) -> None:
        for q in self._kv_subscribers:
            q.put_nowait((kind, hashes, lora_names, medium))

    def end_all(self, err: BaseException) -> int:
        """Raise ``err`` in every caller waiting on a request (on the event loop); their requests are aborted
        as the callers unwind. A draining worker out of time ends its requests this way. Returns how many."""
        for stream in self._streams.values():
            stream.put_nowait(err)
        return len(self._streams)

    def _fail_all(self, err: EngineFailed) -> None:
        """On the event loop, after the engine thread died: fail every stream and every pending command."""
        self.failure = err
        for stream in self._streams.values():
            stream.put_nowait(err)
        while True:
            try:
                kind, arg = self._deferred.popleft() if self._deferred else self._cmds.get_nowait()
            except queue.Empty:
                break
            fut = arg[-1] if kind in ("add", "call", "kv_snapshot") else None
            if fut is not None:
                _resolve(fut, None, err)
        if self.on_failure is not None:
            self.on_failure(err)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)


def _resolve(fut: asyncio.Future[Any], result: Any, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(result)
    else:
        fut.set_exception(err)
