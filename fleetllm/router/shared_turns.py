"""Responses API turns in the shared state store (``--state-url``): a follow-up may reach any router.

A router records each stored response's turn (:class:`~fleetllm.router.sessions.Turn`: the worker holding it,
its items, its parent's id) under ``fleetllm:<namespace>:resp:<response id>`` for ``ttl_s``. A router that
does not know a ``previous_response_id`` loads the turn and its ancestors from there, so the follow-up is
pinned to the worker holding the conversation (or re-sent with its history inline when that worker is gone),
whichever router the client reached. The keys name workers, so they are namespaced per fleet
(``--state-namespace``): two fleets may share one store.

The store is an optimisation of what works without it: a failed write or read is logged once and ignored
(the turn is then known to its own router only, as without a store).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from fleetllm.router.sessions import Turn
from fleetllm.router.state_url import redact

log = logging.getLogger(__name__)


class SharedTurns:
    """Turns of the Responses API kept in Redis at ``url`` for every router of the fleet ``namespace``."""

    def __init__(self, url: str, namespace: str, ttl_s: float = 3600.0, max_depth: int = 256,
                 timeout_s: float = 0.5) -> None:
        self.url, self.prefix = url, f"fleetllm:{namespace}:resp:"
        self.ttl_ms, self.max_depth = int(ttl_s * 1000), max_depth
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry=Retry(NoBackoff(), 0))
        self._pending: set[asyncio.Task[None]] = set()
        self._failing = False

    def save(self, response_id: str, turn: Turn) -> None:
        """Record ``turn`` in the background (the answer it belongs to is not held up)."""
        doc = {"worker": turn.worker, "items": turn.items, "parent": turn.parent.response_id if turn.parent else None,
               "owner": turn.owner}
        task = asyncio.get_running_loop().create_task(self._write(response_id, json.dumps(doc)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, response_id: str, doc: str) -> None:
        try:
            await self.client.set(self.prefix + response_id, doc, px=self.ttl_ms)
            self._failing = False
        except Exception as e:  # the turn stays this router's own
            self._failed(e)

    async def load(self, response_id: str) -> Turn | None:
        """The turn of ``response_id`` with its ancestors, or None (unknown, expired, or the store unreachable)."""
        docs: list[tuple[str, dict[str, Any]]] = []
        rid: str | None = response_id
        try:
            while rid is not None and len(docs) < self.max_depth:
                raw = await self.client.get(self.prefix + rid)
                if raw is None:
                    break
                doc = json.loads(raw)
                docs.append((rid, doc))
                rid = doc.get("parent")
        except Exception as e:
            self._failed(e)
            return None
        turn = None
        for rid, doc in reversed(docs):  # the oldest first: each turn links to the one before
            turn = Turn(str(doc["worker"]), list(doc["items"]), turn, rid, str(doc.get("owner") or ""))
        return turn

    def _failed(self, e: BaseException) -> None:
        if not self._failing:
            log.warning("state store %s: Responses turns not shared (%s)", redact(self.url), type(e).__name__)
            self._failing = True

    async def close(self) -> None:
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self.client.aclose()
