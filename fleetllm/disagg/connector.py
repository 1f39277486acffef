"""Disaggregated prefill/decode as a KV connector (:mod:`fleetllm.engine.kv_connector`).

The prefill side streams a request's KV out as each layer computes it (:class:`~.layer_stream.LayerStream`:
into a frame over shared memory or HTTP, or into blocks a decode worker on this host reserved in its shared
pool), or computes it in place in those blocks. The engine knows none of this: it asks the connector

- on the scheduler side, whether a request's step runs alone (computed in place: the step's KV goes to the
  other pool) and whether its blocks here may be cached (not once computed in place: they hold nothing of
  it), and what the step's worker side does (:class:`PDStepMeta`: the streams the step feeds, the request
  it places);
- on the worker side, where the step computes (:meth:`start_load_kv`: the other pool, what this request
  computed here before copied there first), whether a layer may still be written (the lease's fence), and
  each layer once written (:meth:`save_kv_layer`: the streams copy its completed blocks out).

The decode side reaches the pool only through :attr:`blocks` (:class:`~fleetllm.engine.kv_connector.BlockAccess`),
on the engine thread: a frame's blocks reserved, committed, held for a handoff or released (:mod:`.kv_io`,
:mod:`.leases`, :mod:`.handoffs`).

Requests are matched to their streams by their engine request id (the prefill job's, exactly). A request
computed in place is its own from then on: its blocks here are stale, so a later step of it with no stream
(the writer gave up) fails that request alone rather than compute over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetllm.engine.kv_connector.base import KVConnectorBase, KVConnectorMetadata, Layers, StepKV

if TYPE_CHECKING:
    import torch

    from fleetllm.disagg.layer_stream import LayerFn, LayerStream, PlacedKV
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.engine.scheduler import SchedulerOutput
    from fleetllm.engine.sequence import Sequence


@dataclass
class _Tap:
    """One scheduled request whose KV a stream takes: its tokens ``[start, start + n)`` this step."""

    seq: Sequence
    stream: LayerStream | None  # None: computed in place before, its stream gone since
    start: int
    n: int


@dataclass
class PDStepMeta(KVConnectorMetadata):
    """The streams one step feeds, and (a step of its own) the request computed in another pool."""

    taps: list[_Tap] = field(default_factory=list)
    placed: _Tap | None = None


class PDConnector(KVConnectorBase):
    """The P/D connector of one worker's engine (both roles: a worker may prefill for others and decode)."""

    def __init__(self) -> None:
        self._streams: dict[str, LayerStream] = {}  # by request id
        self._elsewhere: set[str] = set()  # request ids computed in another pool (streams in place)
        self._placed: set[str] = set()  # ... that took a step there: their blocks here are stale for good
        self._calls: list[LayerFn] = []  # this step's per-layer saves
        self._check: PlacedKV | None = None  # this step's placement (its fence is checked before each layer)

    # ---- streams (engine thread, between steps) -------------------------------------------------------
    def observe(self, request_id: str, stream: LayerStream | None) -> None:
        """Hand ``request_id``'s KV to ``stream`` as each layer writes it, from the next step on (None: stop).
        A stream ``in_place`` has it computed in its target's pool instead."""
        if stream is None:
            self._streams.pop(request_id, None)
            if request_id not in self._placed:
                self._elsewhere.discard(request_id)
            return
        self._streams[request_id] = stream
        if stream.in_place:
            self._elsewhere.add(request_id)

    def attach(self, request_id: str, stream: LayerStream, only_pending: bool) -> bool:
        """:meth:`observe` now, unless ``only_pending`` and the request's prompt is already computed (the
        stream would miss blocks); whether it was attached."""
        if only_pending and (self.blocks is None or not self.blocks.prompt_pending(request_id)):
            return False
        self.observe(request_id, stream)
        return True

    # ---- scheduler side -------------------------------------------------------------------------------
    def runs_alone(self, seq: Sequence) -> bool:
        return seq.request_id in self._elsewhere

    def caches_locally(self, seq: Sequence) -> bool:
        return seq.request_id not in self._elsewhere

    def build_connector_meta(self, sched: SchedulerOutput) -> KVConnectorMetadata:
        meta = PDStepMeta()
        for s in sched.scheduled:
            rid = s.seq.request_id
            stream = self._streams.get(rid)
            tap = _Tap(s.seq, stream, s.seq.num_computed_tokens, s.num_new_tokens)
            if rid in self._elsewhere:
                meta.placed = tap  # the scheduler ran it alone
                self._placed.add(rid)
            elif stream is not None:
                meta.taps.append(tap)
        meta.per_layer = bool(meta.taps) or meta.placed is not None
        return meta

    def request_finished(self, seq: Sequence) -> None:
        rid = seq.request_id
        self._placed.discard(rid)
        if rid not in self._streams:
            self._elsewhere.discard(rid)

    # ---- worker side ----------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata, kv_cache: Layers) -> StepKV | None:
        """The other pool when the step is placed there (raises when it is out of reach: the request's blocks
        here are stale, the step fails it alone); each stream's per-layer save begun."""
        self._calls, self._check = [], None
        if not isinstance(meta, PDStepMeta):
            return None
        bs = self.blocks.pool.block_size
        placed = None
        if (p := meta.placed) is not None:
            placed = p.stream.place(p.seq, p.start, p.n, bs, kv_cache) if p.stream is not None else None
            if placed is None:
                raise RuntimeError(f"{p.seq.request_id}: its KV is computed in another worker's pool, out of reach now")
            self._check = placed
        for t in [*meta.taps, *([meta.placed] if placed is not None else [])]:
            fn = t.stream.begin(t.seq, t.start, t.n, bs)
            if fn is not None:
                self._calls.append(fn)
        meta.per_layer = bool(self._calls) or placed is not None  # nothing to save this step: no hooks at all
        return placed

    def wait_for_layer_load(self, layer: int) -> None:
        if self._check is not None:
            self._check.check()  # past the lease: this step must not write there

    def save_kv_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        for fn in self._calls:
            fn(layer, k_cache, v_cache)

    def wait_for_save(self) -> None:
        self._calls, self._check = [], None  # the streams' sealers finish on their own thread


def pd_connector(engine: LLMEngine) -> PDConnector:
    """``engine``'s P/D connector, attached now if it has none (between steps)."""
    c = engine.kv_connector_of(PDConnector)
    if c is None:
        c = PDConnector()
        engine.add_kv_connector(c)
    return c
