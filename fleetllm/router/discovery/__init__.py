"""Worker discovery: sources (a Ray cluster, Kubernetes EndpointSlices) that keep the router's worker set current.

A source produces the set of workers that should be routable; :func:`reconcile` applies the difference to a
running :class:`~fleetllm.router.gateway.Router` (new workers added and health-checked, vanished ones
removed). Each source lives in its own module here and runs as a background task of the router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetllm.router.backends import fleetllm_spec

if TYPE_CHECKING:
    from fleetllm.router.gateway import Router


@dataclass(frozen=True)
class DiscoveredWorker:
    """One worker as a discovery source sees it."""

    url: str
    zone: str = ""
    role: str = "both"
    model: str | None = None
    variant: str = ""


async def reconcile(gateway: Router, wanted: set[DiscoveredWorker], owned: set[str]) -> set[str]:
    """Add the wanted workers the gateway lacks and remove the ones this source added that are gone.

    ``owned`` is the set of URLs this source added earlier (workers given by hand are never removed);
    the new owned set is returned.
    """
    known = {w.url for w in gateway.workers}
    for w in wanted:
        url = w.url.rstrip("/")
        if url not in known:
            gateway.add_worker(fleetllm_spec(url), zone=w.zone, role=w.role, model=w.model, variant=w.variant)
    urls = {w.url.rstrip("/") for w in wanted}
    for url in owned - urls:
        if url in {w.url for w in gateway.workers}:
            await gateway.remove_worker(url)
    return urls
