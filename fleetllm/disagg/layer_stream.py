"""A prefill's KV blocks, written out layer by layer while the forward computes later layers.

The model runner calls :meth:`LayerStream.begin` for every step the tapped request takes part in, and
the function it returns after each decoder layer's attention has written that layer's K and V to the
cache. Each call copies the blocks this step completed, for that layer, straight from the pool into the
target (:class:`Target`): a frame (a shared-memory mapping, or memory streamed over HTTP), or the blocks a
decode worker on this host reserved in its own shared pool (:class:`fleetllm.disagg.direct.PoolTarget`).
The copying is spread over the prefill's chunks. In the step that completes the prompt, each layer is also
handed to a sealer thread (a frame's CRC, then ``on_sealed``: the HTTP sender ships it) while later layers
still compute; the last layer's seal finishes the target and completes :attr:`LayerStream.done`. Full
blocks travel as they complete; the prompt's partial last block (when the target's header has one) in the
step that completes the prompt.

**In place** (``in_place``: a :class:`~fleetllm.disagg.direct.PoolTarget` holding a block for each of the
prompt's): nothing is copied after the layers. Each step of the request computes straight in the decode
worker's blocks (:meth:`LayerStream.place`, the KV connector's :class:`~fleetllm.engine.kv_connector.StepKV`),
in a step of its own; what it computed here before (a first chunk computed before the reservation was
answered, prefix hits) is copied there first, once.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

from fleetllm.engine.kv_connector.base import StepKV
from fleetllm.engine.omp_team import make_serial

if TYPE_CHECKING:
    from fleetllm.disagg.direct import PoolTarget
    from fleetllm.disagg.frame import FrameHeader
    from fleetllm.engine.sequence import Sequence

Layers = list[tuple[torch.Tensor, torch.Tensor]]
LayerFn = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class PlacedKV(StepKV):
    """A step computed in a decode worker's pool: ``check``, before each layer's writes, raises once that pool
    may no longer be written (the lease's fence)."""

    check: Callable[[], None] = lambda: None


class Target(Protocol):
    """Where a prefill's blocks go (a :class:`~fleetllm.disagg.frame.FrameBuffer`, a direct pool write)."""

    header: FrameHeader  # the prompt's full blocks

    def put(self, i: int, first: int, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        """Engine thread: blocks ``[first, first + len(index))`` of layer ``i``, from ``k``/``v`` at ``index``."""
        ...

    def seal(self, i: int) -> None:
        """Sealer thread: layer ``i`` is final."""
        ...

    def finish(self) -> None:
        """Sealer thread: every layer is final (raise: the target is unusable)."""
        ...


class LayerStream:
    """Fills ``target`` from the forward passes of one request (its header lists the prompt blocks)."""

    def __init__(self, target: Target, on_sealed: Callable[[int], None] | None = None, in_place: bool = False) -> None:
        """``on_sealed(i)``, in the sealer thread, once layer ``i`` is final (``num_layers``: the trailer);
        ``in_place``: computed in the target's pool (see the module's doc)."""
        self.target = target
        self.on_sealed = on_sealed
        self.in_place = in_place
        self.sent = 0  # blocks [0, sent) are in the target, every layer
        self.final = False  # the step that completes the prompt has begun
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-seal", initializer=make_serial)

    def begin(self, seq: Sequence, start: int, n: int, block_size: int) -> LayerFn | None:
        """Engine thread, before a forward computing ``seq``'s tokens ``[start, start + n)``: what to do
        after each layer (None: nothing this step)."""
        whole = start + n >= len(seq.prompt_token_ids)  # the prompt's end: its partial block too
        end = self.target.header.num_blocks if whole else min((start + n) // block_size, self.target.header.num_blocks)
        final = whole and not self.final
        if end <= self.sent and not final:
            return None
        first, ids = self.sent, list(seq.block_table[self.sent : end])
        self.sent, self.final = max(self.sent, end), self.final or final
        index: list[torch.Tensor] = []

        def after_layer(i: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
            if ids:
                if not index:
                    index.append(torch.tensor(ids, dtype=torch.long, device=k_cache.device))
                self.target.put(i, first, k_cache.view(-1, block_size, *k_cache.shape[1:]),
                                v_cache.view(-1, block_size, *v_cache.shape[1:]), index[0])
            if final:
                self._sealer.submit(self._seal, i)

        return after_layer

    def place(self, seq: Sequence, start: int, n: int, block_size: int, kv_cache: Layers) -> PlacedKV | None:
        """Engine thread, before :meth:`begin`: the target's pool for a step computing ``seq``'s tokens ``[start,
        start + n)`` in place, the blocks it computed in ``kv_cache`` (this worker's pool) before copied into their
        pool blocks first; None unless in place (or once the target is closed)."""

        t = cast("PoolTarget", self.target)
        if not self.in_place or t.closed:
            return None
        done = -(-start // block_size)  # blocks holding tokens computed here before, the partial one too
        if done > self.sent:
            index = torch.tensor(seq.block_table[self.sent : done], dtype=torch.long, device=kv_cache[0][0].device)
            for i, (kc, vc) in enumerate(kv_cache):
                t.put(i, self.sent, kc.view(-1, block_size, *kc.shape[1:]), vc.view(-1, block_size, *vc.shape[1:]), index)
        whole = start + n >= len(seq.prompt_token_ids)
        end = t.header.num_blocks if whole else min((start + n) // block_size, t.header.num_blocks)
        self.sent = max(self.sent, done, end)  # begin copies nothing of this step: it is written there already
        return PlacedKV(t.flat, t.blocks[: len(seq.block_table)], t.check)

    def _seal(self, i: int) -> None:
        try:
            self.target.seal(i)
            if self.on_sealed:
                self.on_sealed(i)
            if i == self.target.header.num_layers - 1:
                self.target.finish()
                if self.on_sealed:
                    self.on_sealed(i + 1)
                self.done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - the waiting sender must hear of it
            if not self.done.done():
                self.done.set_exception(e)

    def close(self) -> None:
        """Stop the sealer thread (after the frame is done, or abandoned)."""
        self._sealer.shutdown(wait=False, cancel_futures=True)

