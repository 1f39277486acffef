"""The decode side's handed-over prefills: a prompt's KV held in pool blocks until its request arrives.

A prefill worker that computed a whole prompt and sampled its first token hands both over
(:mod:`fleetllm.engine.handoff`): the KV arrives like any transfer (a direct write committed, a frame
imported), but instead of being released into the prefix cache, every block of the prompt stays held — the
partial last block too, which is never registered — under a handoff id, with the first token once the
prefill worker sends it. The request names the id (:data:`HEADER`); the worker claims the handoff and its
engine takes the blocks and the token over. The full blocks are registered in the prefix cache at once, as
after any import.

The router mints the id (the transfer's) and forwards the request as soon as the remote prefill starts, with
how long to wait for it (:data:`WAIT_HEADER`): the request then waits here (:meth:`Handoffs.wait`) until the
handoff has its first token, or the transfer ended without one to take (a plain import: a request of several
prompts or choices; or the router abandoned it: ``POST /pd/abandon``, the remote leg failed), or the wait is
over; then it runs, from the handoff or from whatever the prefix cache holds. The router's hop, the request's
parsing and the prefill worker's answer are thus all off the first token's path.

A handoff nobody claims within :data:`TTL_S` (the request went elsewhere, its client left) is freed: the
full blocks stay cached, the partial one goes back to the free list. One without its first token is freed
when claimed: the request then runs as after a plain import. Torch-free (the transfer code loads lazily).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetllm.engine.handoff import Handoff
from fleetllm.engine.outputs import TokenLogprob
from fleetllm.server.protocol import APIError

if TYPE_CHECKING:
    from fleetllm.disagg.kv_io import Reservation
    from fleetllm.engine.kv_connector.access import BlockAccess

HEADER = "x-fleetllm-kv-handoff"  # on the request the router forwards: the handoff to take over
WAIT_HEADER = "x-fleetllm-kv-handoff-wait"  # seconds the request may wait for it to arrive
MAX_WAIT_S = 600.0
TTL_S = 15.0  # a handoff's request is waiting for it, or comes within milliseconds: seconds are plenty
TICK_S = 0.5
_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


@dataclass
class _Held:
    token_ids: list[int]
    blocks: list[int]
    hashes: list[int]
    deadline: float
    first: dict[str, Any] | None = None
    lora_name: str | None = None  # the adapter the KV was computed with (the frame's)


class Handoffs:
    """Handoffs held on one decode worker, by id; ended by :meth:`claim` or expiry."""

    def __init__(self, blocks: BlockAccess) -> None:
        self.blocks = blocks  # the engine's blocks, edited on its thread (the KV connector's access)
        self._held: dict[str, _Held] = {}
        self._ended: dict[str, float] = {}  # transfers over with nothing to take over, until when remembered
        self._arrivals: dict[str, asyncio.Event] = {}  # requests waiting for their transfer
        self._watch: asyncio.Task[None] | None = None
        self.observe: Callable[[str, float], None] | None = None  # (how a wait ended, its seconds): metrics

    def __len__(self) -> int:
        return len(self._held)

    async def commit(self, res: Reservation, first: dict[str, Any] | None = None,
                     transfer: str | None = None) -> dict[str, Any]:
        """Register ``res``'s full blocks and hold all of them as a handoff (with ``first``, the first token, if
        known yet) under ``transfer`` (the router's id; else a new one); the import's result with ``handoff``,
        its id (absent when a block found no room, or the transfer was already abandoned: nothing held)."""
        from fleetllm.disagg.kv_io import commit_held

        result, table = await self.blocks.call(commit_held, res)
        if table is None:
            return result
        h = res.header
        hid = transfer or uuid.uuid4().hex
        held = _Held(list(h.token_ids), table, list(h.block_hashes), time.monotonic() + TTL_S, first, h.lora_name)
        if hid in self._held or hid in self._ended:  # abandoned already (or an id used twice): its request moved on
            await self._free(held)
            return result
        self._held[hid] = held
        self._watching()
        if first is not None:
            self._wake(hid)
        return {**result, "handoff": hid}

    def give_first(self, hid: str, first: dict[str, Any]) -> bool:
        """The first token of handoff ``hid`` (False: no such handoff, or it was claimed or expired)."""
        held = self._held.get(hid)
        if held is None:
            return False
        held.first = first
        self._wake(hid)
        return True

    def ended(self, transfer: str) -> None:
        """Transfer ``transfer`` is over with no handoff to take (imported plainly, or abandoned by the router):
        its request, waiting or still to come, runs at once."""
        self._ended[transfer] = time.monotonic() + TTL_S
        self._watching()
        self._wake(transfer)

    async def wait(self, transfer: str, wait_s: float) -> str:
        """Until handoff ``transfer`` has its first token, the transfer ended without one, or ``wait_s`` passed;
        which of these (``handed_over``, ``ended``, ``timeout``)."""
        t0 = time.monotonic()
        outcome = self._outcome(transfer)
        if outcome is None:
            event = self._arrivals.setdefault(transfer, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                self._arrivals.pop(transfer, None)
            outcome = self._outcome(transfer) or "timeout"
        if self.observe is not None:
            self.observe(outcome, time.monotonic() - t0)
        return outcome

    async def claim(self, hid: str | None, usable: bool = True) -> Handoff | None:
        """Take handoff ``hid`` over (None: unknown, expired, no first token, or not ``usable``: then freed)."""
        held = self._held.pop(hid, None) if hid else None
        if held is None:
            return None
        handoff = _handoff(held) if usable else None
        if handoff is None:
            await self._free(held)
        return handoff

    def _outcome(self, transfer: str) -> str | None:
        held = self._held.get(transfer)
        if held is not None and held.first is not None:
            return "handed_over"
        return "ended" if transfer in self._ended else None

    def _wake(self, transfer: str) -> None:
        event = self._arrivals.get(transfer)
        if event is not None:
            event.set()

    def _watching(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._expire())

    async def _free(self, held: _Held) -> None:
        from fleetllm.disagg.kv_io import release

        with contextlib.suppress(Exception):  # the engine stopped: nothing left to free
            await self.blocks.call(release, held.blocks)

    async def _expire(self) -> None:
        while self._held or self._ended:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for t in [k for k, until in self._ended.items() if until < now]:
                del self._ended[t]
            for hid in [k for k, v in self._held.items() if v.deadline < now]:
                held = self._held.pop(hid, None)
                if held is not None:
                    await self._free(held)


def transfer_id(value: Any) -> str | None:
    """A transfer id as the router names it (None: absent); a 400 naming ``transfer_id`` if malformed."""
    if value is None:
        return None
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise APIError(400, "a transfer id is 1-64 letters, digits, '-' or '_'", "transfer_id")
    return value


def wait_of(headers: Mapping[str, str]) -> float:
    """Seconds a request may wait for its handoff (:data:`WAIT_HEADER`; 0: absent or malformed)."""
    try:
        wait = float(headers.get(WAIT_HEADER) or 0.0)
    except ValueError:
        return 0.0
    return min(max(wait, 0.0), MAX_WAIT_S) if math.isfinite(wait) else 0.0


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
    return Handoff(held.token_ids, held.blocks, held.hashes, tok, lp, state, held.lora_name)
