"""The prefill side of a direct write: a prompt's KV written straight into a same-host decode worker's pool.

1. ``POST /pd/reserve`` to the decode worker (before the prefill starts, or while a long prompt's first chunk
   computes): it holds pool blocks under a lease and answers its pool file's layout and, per prompt block, the
   pool block to write (-1: skip).
2. While the prefill computes, the :class:`~fleetllm.disagg.layer_stream.LayerStream` writes each layer's
   blocks into those pool blocks (:class:`PoolTarget`), converting to the pool's dtype if it differs; its first
   step writes every block computed before the reservation was answered. A prefill worker computes in them
   instead (``whole``: a block reserved for each of the prompt's; the stream ``in_place``): nothing to copy.
3. ``POST /pd/commit``: the decode worker registers the full blocks as cached prefix blocks and, given the
   prompt's first token, holds every block (the partial last one too) for the request (a handoff). Nothing
   is copied or checked after the prefill's last layer: the exposed cost is this round trip.
4. Computed in place: the commit keeps the full blocks for :func:`read_back` into this worker's own prefix
   cache, then the lease is released.

No checksum on this path: the bytes never leave the host's memory (no wire, no file read back), so a CRC
would only re-read what the writer just wrote; frames, which cross a wire or are read from a buffer the
receiver does not own, keep theirs. What can go wrong here is a writer that stops half-way, which the lease
covers: nothing is registered without a commit. :class:`PoolTarget` writes nothing once the lease's time has
passed (measured from before the reservation was sent) or once it is closed, and then refuses to finish.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from fleetllm.disagg.frame import FrameError, FrameHeader, gather_into
from fleetllm.disagg.leases import KEEP_S, pid_namespace
from fleetllm.disagg.shared_pool import PoolLayout, PoolMaps
from fleetllm.kernels import kv8

if TYPE_CHECKING:
    import httpx

    from fleetllm.engine.kv_connector.access import BlockAccess

Layers = list[tuple[torch.Tensor, torch.Tensor]]
_MAX_RUNS = 8  # more runs of consecutive pool blocks than this: one indexed copy per tensor instead


@dataclass
class PoolTarget:
    """A LayerStream target: the prompt's blocks written into the decode pool's reserved blocks."""

    header: FrameHeader
    pool: Layers  # the decode pool's K and V per layer, mapped here
    blocks: list[int]  # per prompt block, its pool block (-1: not to write)
    deadline: float  # this process's time.monotonic(): no write at or after it
    closed: bool = False
    missed: bool = False  # a write was skipped: the blocks must not be committed
    _plans: dict[tuple[int, int], Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes this target writes (K and V, every layer, the blocks to write)."""
        k = self.pool[0][0]
        per_block = k[0].numel() * k.element_size()
        return 2 * len(self.pool) * per_block * sum(b >= 0 for b in self.blocks)

    def put(self, i: int, first: int, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        """Engine thread: prompt blocks ``[first, first + len(index))`` of layer ``i``, gathered from ``k`` and
        ``v`` (``[blocks, block_size, ...]``) at ``index``, into their pool blocks."""
        if self._fenced():
            return
        plan = self._plan(first, index)
        for src, dst in ((k, self.pool[i][0]), (v, self.pool[i][1])):
            if isinstance(plan, tuple):  # scattered pool blocks: one gather, one scatter
                kv8.copy_rows(dst, plan[1], src.index_select(0, plan[0]))
            else:
                for a, d, n in plan:  # a few runs of consecutive pool blocks: one copy each
                    gather_into(src, index[a : a + n], dst[d : d + n])

    def _plan(self, first: int, index: torch.Tensor) -> list[tuple[int, int, int]] | tuple[torch.Tensor, torch.Tensor]:
        """How prompt blocks ``[first, first + len(index))`` go into the pool: runs ``(offset in index, pool
        block, count)`` of consecutive pool blocks, or (many runs) the source and pool block indices."""
        key = (first, len(index))
        if key not in self._plans:
            pairs = [(j, self.blocks[first + j]) for j in range(len(index)) if self.blocks[first + j] >= 0]
            runs: list[list[int]] = []
            for j, d in pairs:
                if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == d:
                    runs[-1][2] += 1
                else:
                    runs.append([j, d, 1])
            if len(runs) > _MAX_RUNS:
                src = index[torch.tensor([j for j, _ in pairs], dtype=torch.long, device=index.device)]
                self._plans[key] = (src, torch.tensor([d for _, d in pairs], dtype=torch.long))
            else:
                self._plans[key] = [(a, d, c) for a, d, c in runs]
        return self._plans[key]

    @property
    def flat(self) -> Layers:
        """The pool's K and V per layer as flat ``[slots, kv_heads, head_dim]`` views (a prefill computing in it)."""
        return [(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])) for k, v in self.pool]

    @property
    def whole(self) -> bool:
        """Whether every block of the prompt has a pool block (none cached there already): computable in place."""
        return len(self.blocks) == self.header.num_blocks and min(self.blocks, default=0) >= 0

    def check(self) -> None:
        """Engine thread, before a layer computing in the pool writes: raise :class:`FrameError` once the lease's
        time has passed or the target is closed (the blocks may be another request's by then)."""
        if self._fenced():
            raise FrameError("the lease ended (or the write was abandoned) before every layer was written")

    def _fenced(self) -> bool:
        """Whether nothing may be written any more (closed, or the lease's time passed): then marked missed."""
        fenced = self.closed or time.monotonic() >= self.deadline
        self.missed = self.missed or fenced
        return fenced

    def seal(self, i: int) -> None:
        return None  # nothing to checksum: see the module's doc

    def finish(self) -> None:
        if self.missed:
            raise FrameError("the lease ended (or the write was abandoned) before every layer was written")

    def close(self) -> None:
        """No write after this (the engine thread no longer calls :meth:`put` for this request)."""
        self.closed = True


@dataclass
class DirectLeg:
    """One direct write's lease on the decode worker at ``url``."""

    url: str
    lease: str
    target: PoolTarget
    layout: PoolLayout
    reserve_s: float


async def reserve(client: httpx.AsyncClient, url: str, header: FrameHeader, maps: PoolMaps,
                  lease_s: float, whole: bool = False) -> DirectLeg | None:
    """Reserve blocks for ``header``'s prompt on the decode worker at ``url`` and map its pool; None when it
    cannot take a direct write (pool not shared, reservation refused, file not mappable here): send a frame.
    ``whole``: a block for each of the prompt's, those cached there too (to compute in place).
    Raises ``httpx.HTTPError`` when the decode worker cannot be reached."""
    t0 = time.monotonic()
    r = await client.post(url + "/pd/reserve", json={
        "header": header.to_json(), "lease_s": lease_s, "pid": os.getpid(), "pid_ns": pid_namespace(),
        "whole": whole}, timeout=10.0)
    if r.status_code != 200:
        return None
    answer = r.json()
    try:
        layout = PoolLayout.parse(answer.get("pool"))
        blocks, lease_s = _lease_of(answer, header, layout)  # checked before anything is mapped or written
        pool = maps.layers(layout)
    except (OSError, ValueError):
        await release(client, url, str(answer.get("lease")))
        return None
    target = PoolTarget(header, pool, blocks, t0 + lease_s)
    # the blocks' pages mapped here on a spare thread while the prefill starts, not one fault per 4 KiB of the
    # engine thread's writes (not awaited: it writes nothing, so it may finish whenever)
    asyncio.get_running_loop().run_in_executor(None, maps.prefault, layout, target.blocks)
    return DirectLeg(url, str(answer["lease"]), target, layout, time.monotonic() - t0)


def _lease_of(answer: dict[str, Any], header: FrameHeader, layout: PoolLayout) -> tuple[list[int], float]:
    """A reservation's blocks and seconds; ValueError unless the pool is laid out as ``header``'s KV, there is a
    block (or -1) for each of its blocks, each in the pool, and the lease is a finite positive time: a write
    past the pool would fail the prefill worker's step, and with it every request in that step."""
    blocks, lease_s = answer.get("blocks"), answer.get("lease_s")
    shape = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if shape != (header.num_layers, header.block_size, header.num_kv_heads, header.head_dim):
        raise ValueError(f"a pool laid out as {shape} for a prompt of {header.shape}")
    if not (isinstance(blocks, list) and len(blocks) == header.num_blocks
            and all(isinstance(b, int) and -1 <= b < layout.num_blocks for b in blocks)):
        raise ValueError("the reservation's blocks are not one per prompt block, each in the pool")
    if isinstance(lease_s, bool) or not isinstance(lease_s, int | float) or not 0 < lease_s < float("inf"):
        raise ValueError(f"a lease of {str(lease_s)[:40]} seconds")
    return blocks, float(lease_s)


async def commit(client: httpx.AsyncClient, leg: DirectLeg, timeout: float, first: dict[str, Any] | None = None,
                 transfer: str | None = None, keep: bool = False) -> dict[str, Any]:
    """The decode worker registers the written blocks (with ``first``, the prompt's first token: and holds them
    for the request, a handoff, under ``transfer`` if given; ``keep``: and keeps the full ones for
    :func:`read_back` until the lease is released); its answer (imported, already cached, dropped, the
    handoff's id, ``kept``). Raises ``httpx.HTTPError``, or ValueError when the decode worker refuses (the lease
    was over)."""
    r = await client.post(leg.url + "/pd/commit", json={"lease": leg.lease, "first": first, "transfer_id": transfer,
                                                        "keep": keep}, timeout=timeout)
    if r.status_code != 200:
        raise ValueError(f"the decode worker refused the commit ({r.status_code}): {r.text[:200]}")
    return r.json()


async def read_back(blocks: BlockAccess, leg: DirectLeg, committed_at: float) -> int:
    """After a commit with ``keep`` (sent at ``committed_at``, this process's ``time.monotonic()``): the prompt's
    full blocks, computed in place in the decode worker's pool, copied into this worker's prefix cache (reserved
    and registered on the engine thread, copied off it), so that its KV events list them and a prompt sharing
    them is not computed again here; the blocks copied. Nothing is registered when the copy ended after the
    decode worker may have let the blocks go (:data:`~fleetllm.disagg.leases.KEEP_S`): FrameError."""
    from fleetllm.disagg import kv_io

    h = leg.target.header
    full = replace(h, token_ids=h.token_ids[: len(h.block_hashes) * h.block_size])
    res = await blocks.call(kv_io.reserve, full)
    try:
        await asyncio.to_thread(kv_io.write, blocks.kv_blocks(), leg.target.pool, res, leg.target.blocks)
        if time.monotonic() >= committed_at + KEEP_S:
            raise FrameError(f"read back more than {KEEP_S:.0f} s after the commit: the blocks may be reused")
    except BaseException:
        await blocks.call(kv_io.cancel, res)
        raise
    return (await blocks.call(kv_io.commit, res))["imported"]


async def release(client: httpx.AsyncClient, url: str, lease: str) -> None:
    """Free the lease's blocks on the decode worker (best effort: else they go when the lease expires)."""
    import httpx

    try:
        await client.post(url + "/pd/release", json={"lease": lease}, timeout=5.0)
    except httpx.HTTPError:
        pass
