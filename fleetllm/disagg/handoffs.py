"""The decode side's handed-over prefills: a prompt's KV held in pool blocks until its request arrives.

A prefill worker that computed a whole prompt and sampled its first token hands both over
(:mod:`fleetllm.engine.handoff`): the KV arrives like any transfer (a direct write committed, a frame
imported), but instead of being released into the prefix cache, every block of the prompt stays held — the
partial last block too, which is never registered — under a handoff id, with the first token once the
prefill worker sends it. The router forwards the request with the id (:data:`HEADER`); the worker claims the
handoff and its engine takes the blocks and the token over. The full blocks are registered in the prefix
cache at once, as after any import.

A handoff nobody claims within :data:`TTL_S` (the router gave up, the request went elsewhere) is freed: the
full blocks stay cached, the partial one goes back to the free list. One without its first token is freed
when claimed: the request then runs as after a plain import. Torch-free (the transfer code loads lazily).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetllm.engine.handoff import Handoff
from fleetllm.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from fleetllm.disagg.kv_io import Reservation
    from fleetllm.engine.async_engine import AsyncEngine

HEADER = "x-fleetllm-kv-handoff"  # on the request the router forwards: the handoff to take over
TTL_S = 15.0  # the router forwards the request as soon as the prefill answers: seconds are plenty
TICK_S = 0.5


@dataclass
class _Held:
    token_ids: list[int]
    blocks: list[int]
    hashes: list[int]
    deadline: float
    first: dict[str, Any] | None = None


class Handoffs:
    """Handoffs held on one decode worker, by id; ended by :meth:`claim` or expiry."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._held: dict[str, _Held] = {}
        self._watch: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._held)

    async def commit(self, res: Reservation, first: dict[str, Any] | None = None) -> dict[str, Any]:
        """Register ``res``'s full blocks and hold all of them as a handoff (with ``first``, the first token, if
        known yet); the import's result with ``handoff``, its id (absent when a block found no room)."""
        from fleetllm.disagg.kv_io import commit_held

        result, table = await self.engine.call(lambda e: commit_held(e, res))
        if table is None:
            return result
        h = res.header
        hid = uuid.uuid4().hex
        self._held[hid] = _Held(list(h.token_ids), table, list(h.block_hashes), time.monotonic() + TTL_S, first)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._expire())
        return {**result, "handoff": hid}

    def give_first(self, hid: str, first: dict[str, Any]) -> bool:
        """The first token of handoff ``hid`` (False: no such handoff, or it was claimed or expired)."""
        held = self._held.get(hid)
        if held is None:
            return False
        held.first = first
        return True

    async def claim(self, hid: str | None, usable: bool = True) -> Handoff | None:
        """Take handoff ``hid`` over (None: unknown, expired, no first token, or not ``usable``: then freed)."""
        held = self._held.pop(hid, None) if hid else None
        if held is None:
            return None
        handoff = _handoff(held) if usable else None
        if handoff is None:
            await self._free(held)
        return handoff

    async def _free(self, held: _Held) -> None:
        with contextlib.suppress(Exception):  # the engine stopped: nothing left to free
            await self.engine.call(lambda e: e.pool.release(held.blocks))

    async def _expire(self) -> None:
        while self._held:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for hid in [k for k, v in self._held.items() if v.deadline < now]:
                held = self._held.pop(hid, None)
                if held is not None:
                    await self._free(held)


def first_token_json(token: int, logprob: TokenLogprob | None, sampler_state: bytes | None) -> dict[str, Any]:
    """A first token as the prefill worker sends it."""
    out: dict[str, Any] = {"token": token}
    if logprob is not None:
        out["logprob"], out["top"] = logprob.logprob, [list(t) for t in logprob.top]
    if sampler_state is not None:
        out["sampler_state"] = base64.b64encode(sampler_state).decode()
    return out


def _handoff(held: _Held) -> Handoff | None:
    """The engine's handoff from a held one (None: no first token yet, or a malformed one)."""
    f = held.first
    if not isinstance(f, dict):
        return None
    try:
        tok = int(f["token"])
        lp = None if "logprob" not in f else TokenLogprob(tok, float(f["logprob"]),
                                                           [(int(i), float(v)) for i, v in f.get("top") or []])
        state = base64.b64decode(f["sampler_state"]) if f.get("sampler_state") else None
    except (KeyError, TypeError, ValueError):
        return None
    return Handoff(held.token_ids, held.blocks, held.hashes, tok, lp, state)
