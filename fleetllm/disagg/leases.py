"""Pool blocks a decode worker holds for a prefill worker on its host that writes a prompt's KV into them.

``POST /pd/reserve`` reserves the blocks a prompt's KV needs (:func:`fleetllm.disagg.kv_io.reserve`: fresh
blocks for what is not cached here, cached ones pinned) under a lease of ``lease_s`` seconds. The lease ends
in one of three ways:

- **commit** (``POST /pd/commit``, the writer is done): the full blocks are registered as cached prefix blocks
  and released, exactly as an imported frame's (:func:`fleetllm.disagg.kv_io.commit`); or, when the writer
  prefilled the whole prompt (its first token sent with the commit), every block stays held for the request
  as a handoff (:mod:`fleetllm.disagg.handoffs`);
- **release** (``POST /pd/release``, the writer gave up: client gone, prefill failed): freed unregistered;
- **expiry**: ``lease_s`` + :data:`GRACE_S` passed, or the writer's process is gone (checked only when it
  runs in this worker's pid namespace). Freed unregistered: a dead prefill worker never leaks blocks.

A commit with ``keep`` keeps a reference on the written full blocks under the same lease id, for the writer to
read them back into its own prefix cache (a prefill computed in place here left nothing in its own pool):
``POST /pd/release`` (read), the writer's death or :data:`KEEP_S` after the commit (+ :data:`GRACE_S`) drops it;
the blocks stay registered, as any cached block. The writer keeps nothing it read once :data:`KEEP_S` has passed
since it sent the commit (the same fencing as the lease's).

Fencing: the writer writes nothing once ``lease_s`` has passed since it *sent* the reservation (its own
clock; it cannot start before this worker's), and blocks are freed only :data:`GRACE_S` after this worker's
deadline, so a freed block is never written by that writer again. The writer's pid is trusted to be dead
only when ``os.kill(pid, 0)`` says so in the same pid namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetllm.disagg.kv_io import Reservation, cancel, commit, hold, release, reserve
from fleetllm.engine.kv_memory import alive

if TYPE_CHECKING:
    from fleetllm.disagg.frame import FrameHeader
    from fleetllm.disagg.handoffs import Handoffs
    from fleetllm.engine.kv_connector.access import BlockAccess

GRACE_S = 2.0  # after the deadline, before the blocks are freed: the writer's last write is long over
KEEP_S = 30.0  # a commit with keep: how long the writer has to read the blocks back
MAX_LEASE_S = 600.0
TICK_S = 0.25


@dataclass
class Lease:
    """Blocks reserved for one direct write."""

    id: str
    res: Reservation
    deadline: float  # this worker's time.monotonic()
    writer_pid: int | None  # None: not in this pid namespace (only the deadline ends the lease then)

    def targets(self) -> list[int]:
        """For each of the prompt's blocks, the pool block to write it into (-1: cached here, or no room)."""
        out = [-1] * self.res.header.num_blocks
        for i, bid in self.res.copies():
            out[i] = bid
        return out

    def over(self, now: float) -> bool:
        return _over(self.deadline, self.writer_pid, now)


@dataclass
class Kept:
    """Full blocks a commit kept a reference on, for the writer to read back (a lease id's second life)."""

    blocks: list[int]
    deadline: float
    writer_pid: int | None

    def over(self, now: float) -> bool:
        return _over(self.deadline, self.writer_pid, now)


def _over(deadline: float, writer_pid: int | None, now: float) -> bool:
    """Whether blocks held until ``deadline`` for the writer ``writer_pid`` may go: its grace passed, or it is gone."""
    return now > deadline + GRACE_S or (writer_pid is not None and not alive(writer_pid))


def pid_namespace() -> int | None:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), None where there is none to read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class Leases:
    """The decode side's leases, ended by :meth:`commit`, :meth:`release` or a watch task on expiry."""

    def __init__(self, blocks: BlockAccess, handoffs: Handoffs) -> None:
        self.blocks = blocks  # the engine's blocks, edited on its thread (the KV connector's access)
        self.handoffs = handoffs
        self._held: dict[str, Lease] = {}
        self._kept: dict[str, Kept] = {}  # committed with keep: read back by the writer
        self._watch: asyncio.Task[None] | None = None
        self._own_ns = pid_namespace()

    def __len__(self) -> int:
        return len(self._held) + len(self._kept)

    async def reserve(self, header: FrameHeader, lease_s: float, pid: int | None, pid_ns: int | None,
                      whole: bool = False) -> Lease:
        """Blocks for ``header``'s prompt under a new lease (FrameError if it does not fit this engine); ``whole``:
        a fresh one for each of its blocks, cached ones too (:func:`fleetllm.disagg.kv_io.reserve`)."""
        res = await self.blocks.call(reserve, header, whole)
        same_ns = pid is not None and pid_ns is not None and pid_ns == self._own_ns
        lease = Lease(uuid.uuid4().hex, res, time.monotonic() + min(lease_s, MAX_LEASE_S), pid if same_ns else None)
        self._held[lease.id] = lease
        self._watching()
        return lease

    def _watching(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._expire())

    async def commit(self, lease_id: str, first: dict[str, Any] | None = None, transfer: str | None = None,
                     keep: bool = False) -> dict[str, Any] | None:
        """Register the lease's full blocks as cached prefix blocks (with ``first``, the prompt's first token:
        and hold every block as a handoff, under ``transfer`` if given; without: ``transfer``'s request runs
        now); ``keep``: and keep a reference on the written full blocks until released (see the module's doc).
        None if the lease is over (expired, released, unknown)."""
        lease = self._held.pop(lease_id, None)
        if lease is None:
            return None
        if keep:  # referenced before the commit: no moment in which they could be evicted
            full = [bid for i, bid in lease.res.copies() if i < len(lease.res.header.block_hashes)]
            await self.blocks.call(hold, full)
            self._kept[lease_id] = Kept(full, time.monotonic() + KEEP_S, lease.writer_pid)
            self._watching()
        kept = {"kept": len(full)} if keep else {}
        if first is not None:
            return {**await self.handoffs.commit(lease.res, first, transfer), **kept}
        result = await self.blocks.call(commit, lease.res)
        if transfer is not None:
            self.handoffs.ended(transfer)
        return {**result, **kept}

    async def release(self, lease_id: str) -> bool:
        """Free the lease's blocks unregistered (committed with keep: drop the reference kept); False if it was
        already over."""
        lease, kept = self._held.pop(lease_id, None), self._kept.pop(lease_id, None)
        if lease is not None:
            await self.blocks.call(cancel, lease.res)
        if kept is not None:
            await self.blocks.call(release, kept.blocks)
        return lease is not None or kept is not None

    async def _expire(self) -> None:
        while self._held or self._kept:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for lease_id in [k for k, v in [*self._held.items(), *self._kept.items()] if v.over(now)]:
                with contextlib.suppress(Exception):  # the engine stopped: nothing left to free
                    await self.release(lease_id)
