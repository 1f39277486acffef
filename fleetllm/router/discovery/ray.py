"""Ray discovery: the router's workers are the fleet's actors, found by name in the fleet's Ray namespace.

Every second the router lists the named actors of the namespace (``fleetllm-worker:*``, see
fleetllm/fleet/ray_actor.py) and asks each where it listens; :func:`~fleetllm.router.discovery.reconcile`
applies the answer. An actor that has not answered yet (starting, or restarting after its node was lost)
keeps its last address until it answers: the router's health checks, not this loop, stop routing to a worker
that stopped answering, within a health interval. An actor that is gone (killed for good, scaled down) is
dropped, and one that Ray restarted elsewhere replaces its old address with its new one.

Ray is imported only when a router is given ``--ray-address``; the router stays free of it otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from fleetllm.router.discovery import DiscoveredWorker, reconcile

if TYPE_CHECKING:
    from fleetllm.router.gateway import Router

log = logging.getLogger(__name__)
ACTOR_PREFIX = "fleetllm-worker:"  # every fleet copy's actor name starts so (fleetllm/fleet/ray_actor.py)


class RayDiscovery:
    """The fleet's actors in ``namespace`` of the cluster at ``address``, as discovered workers."""

    def __init__(self, address: str, namespace: str, call_timeout_s: float = 2.0) -> None:
        self.address, self.namespace, self.call_timeout_s = address, namespace, call_timeout_s
        self._handles: dict[str, Any] = {}
        self._asking: dict[str, Any] = {}  # name -> an info() call not answered yet (asked once, not per poll)
        self._last: dict[str, DiscoveredWorker] = {}

    def poll(self) -> set[DiscoveredWorker]:
        """One look at the cluster (blocking: run it in a thread)."""
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")  # SIGTERM stays uvicorn's (drain)
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                     logging_level=logging.ERROR)
        names = {n for n in ray.util.list_named_actors() if n.startswith(ACTOR_PREFIX)}
        for gone in set(self._handles) - names:
            self._forget(gone)
        for name in names - set(self._handles):
            try:
                self._handles[name] = ray.get_actor(name)
            except ValueError:
                continue  # gone between the listing and now
        for name, h in self._handles.items():
            if name not in self._asking:
                self._asking[name] = h.info.remote()
        refs = list(self._asking.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
        done = {r.hex() for r in ready}
        for name, ref in list(self._asking.items()):
            if ref.hex() not in done:
                continue  # starting or restarting: its last answer (if any) stands
            del self._asking[name]
            try:
                self._last[name] = _worker(ray.get(ref))
            except ray.exceptions.RayError:
                self._forget(name)  # dead for good
        return set(self._last.values())

    def _forget(self, name: str) -> None:
        for table in (self._handles, self._asking, self._last):
            table.pop(name, None)

    async def run(self, router: Router, interval_s: float = 1.0) -> None:
        """Keep ``router``'s worker set equal to the fleet's actors until cancelled."""
        owned: set[str] = set()
        while True:
            try:
                wanted = await asyncio.to_thread(self.poll)
                owned = await reconcile(router, wanted, owned)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the cluster unreachable for a moment: keep what the router has
                log.warning("ray discovery: %s", e)
            await asyncio.sleep(interval_s)


def _worker(info: dict[str, str]) -> DiscoveredWorker:
    return DiscoveredWorker(url=info["url"], zone=info.get("zone", ""), role=info.get("role", "both"),
                            model=info.get("model") or None, variant=info.get("variant", ""))
