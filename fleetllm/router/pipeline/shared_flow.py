"""Flow control's tenant counts shared through the state store (``--state-url``): N routers, one flow controller.

A gate decides whether a request is bulk work (:meth:`~fleetllm.router.pipeline.admission.Gate.bulk`) by how
many of the model's batch slots its tenant holds. Alone, a router counts only its own requests, so a tenant
spread over two routers holds up to two shares. With a store, every ``interval_s`` each router publishes what
its tenants hold per model (requests let through and not ended, and their weights) in the hash
``fleetllm:<namespace>:flow:<model>:<router id>`` (field: tenant, value: ``"<holding> <weight>"``), which lapses
after a few intervals (a router that dies stops counting), lists itself in ``...:flow:<model>:routers``, and
reads the other routers' hashes into its gate's :attr:`~fleetllm.router.pipeline.admission.Gate.others`. The
workers' own load reports already count every router's requests, so room needs nothing more.

Keys name tenants and models, namespaced per fleet (``--state-namespace``). A store that fails is logged once
and the gates count their own requests only (as without a store) until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from fleetllm.router.state_url import redact

if TYPE_CHECKING:
    from fleetllm.router.pipeline.admission import Gate

log = logging.getLogger(__name__)

LAPSE_INTERVALS = 5  # a router's published counts outlive it by this many intervals


class SharedFlow:
    """Publishes this router's per-tenant holdings and reads the other routers' (see the module's docstring)."""

    def __init__(self, url: str, namespace: str, interval_s: float = 0.2, timeout_s: float = 0.5) -> None:
        self.url, self.prefix = url, f"fleetllm:{namespace}:flow:"
        self.interval_s = interval_s
        self.router_id = uuid.uuid4().hex
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self, gates: Callable[[], dict[str, Gate]]) -> None:
        """Sync ``gates`` (the flow controller's, by model) every ``interval_s`` until :meth:`close`."""
        self._task = asyncio.get_running_loop().create_task(self._loop(gates), name="shared-flow")

    async def _loop(self, gates: Callable[[], dict[str, Gate]]) -> None:
        while True:
            await self.tick(gates())
            await asyncio.sleep(self.interval_s)

    async def tick(self, gates: dict[str, Gate]) -> None:
        """One :meth:`sync`; on a failure the gates count their own requests only (logged once)."""
        try:
            await self.sync(gates)
            if self._failing:
                log.info("flow control's shared counts are back (%s)", redact(self.url))
                self._failing = False
        except Exception as e:  # the store is an optimisation: without it each router counts its own
            for g in gates.values():
                g.others = {}
            if not self._failing:
                log.warning("flow control's shared counts unreachable (%s): %s; each router counts its own",
                            redact(self.url), type(e).__name__)
                self._failing = True

    async def sync(self, gates: dict[str, Gate]) -> None:
        """Publish this router's holdings of each gate's model and read the other routers' into the gates."""
        lapse_ms = int(self.interval_s * LAPSE_INTERVALS * 1000)
        pipe = self.client.pipeline(transaction=False)
        for model, g in gates.items():
            mine = self.prefix + model + ":" + self.router_id
            held = {t: f"{n} {g.weights.get(t, 1.0):g}" for t, n in g.holding.items() if n > 0}
            pipe.delete(mine)
            if held:
                pipe.hset(mine, mapping=held)
                pipe.pexpire(mine, lapse_ms)
            pipe.sadd(self.prefix + model + ":routers", self.router_id)
            pipe.smembers(self.prefix + model + ":routers")
        replies = await pipe.execute()
        members = [r for r in replies if isinstance(r, set)]  # each model's routers, in the gates' order
        read = self.client.pipeline(transaction=False)
        names = []
        for (model, _), routers in zip(gates.items(), members, strict=True):
            for rid in sorted(routers - {self.router_id}):
                names.append((model, rid))
                read.hgetall(self.prefix + model + ":" + rid)
        others: dict[str, dict[str, tuple[int, float]]] = {m: {} for m in gates}
        gone = self.client.pipeline(transaction=False)
        for (model, rid), fields in zip(names, await read.execute() if names else [], strict=True):
            if not fields:  # lapsed (or holding nothing now): listed again by its next sync if it lives
                gone.srem(self.prefix + model + ":routers", rid)
            for tenant, value in fields.items():
                n, w = value.split()
                had = others[model].get(tenant, (0, 0.0))
                others[model][tenant] = (had[0] + int(n), float(w))
        if names:
            await gone.execute()
        for model, g in gates.items():
            g.others = others[model]

    async def close(self) -> None:
        """Stop syncing (this router's published counts lapse)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.client.aclose()
