"""Worker discovery from Kubernetes EndpointSlices: the worker pods of a fleet, by label selector.

A thread lists the EndpointSlices that match ``--k8s-selector`` and then watches them from the list's
resource version (the official ``kubernetes`` client, synchronous); every ``--k8s-resync`` seconds the
watch ends and the slices are listed afresh, and any error (the API server restarting, a dropped
connection, ``410 Gone`` for a too old version) leads to a new list after a short backoff. Each change hands
the endpoints to the router's event loop, which applies the newest state (older ones it has not reached
yet are skipped):

- a ready endpoint is a worker: added (and health-checked by the router) if new, routable again if it
  was draining;
- an endpoint that stops being ready (its pod failed ``/ready``, or is terminating: a worker drains on
  SIGTERM) is drained: no new requests, in-flight ones finish;
- an endpoint that is gone (pod deleted) is removed.

A worker's URL is ``http://ADDRESS:PORT`` (the slice's port named ``--k8s-port``), its zone the endpoint's
zone; model, variant and role come from the slice's labels ``fleetllm.io/model``, ``fleetllm.io/variant``
and ``fleetllm.io/role``, which the EndpointSlice controller copies from the Service
(:mod:`fleetllm.deploy.kubernetes.names`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetllm.cli_options import opt
from fleetllm.router.discovery import DiscoveredWorker, reconcile

if TYPE_CHECKING:
    from fleetllm.router.gateway import Router

log = logging.getLogger(__name__)
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MODEL, VARIANT, ROLE = "fleetllm.io/model", "fleetllm.io/variant", "fleetllm.io/role"


@dataclass
class KubernetesDiscoveryConfig:
    """``fleetllm router --discover kubernetes``: where the worker EndpointSlices are and how to reach the API."""

    k8s_namespace: str | None = opt(None, "namespace of the worker EndpointSlices (default: the router pod's "
                                          "own, else `default`)")
    k8s_selector: str = opt("app.kubernetes.io/component=worker", "label selector of the worker EndpointSlices")
    k8s_port: str = opt("http", "name of the EndpointSlice port the workers serve on")
    kubeconfig: str | None = opt(None, "kubeconfig file (default: the pod's service account in a cluster, else "
                                       "~/.kube/config)")
    k8s_resync_s: float = opt(300.0, "seconds a watch runs before the EndpointSlices are listed afresh")


def discovery_api(kubeconfig: str | None) -> Any:  # -> kubernetes.client.DiscoveryV1Api
    """The EndpointSlice API with the pod's service account (in a cluster) or a kubeconfig file's credentials.

    Raises ValueError, naming the file, when neither is usable: a router that cannot discover must not start."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    except (config.ConfigException, OSError) as e:
        raise ValueError(f"no Kubernetes API access (kubeconfig {kubeconfig or '~/.kube/config'}, not in a "
                         f"cluster): {e}") from None
    return client.DiscoveryV1Api(client.ApiClient(configuration))


def default_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def endpoints(slices: Iterable[dict[str, Any]], port_name: str) -> dict[str, tuple[DiscoveredWorker, bool]]:
    """Every endpoint of ``slices`` (EndpointSlice objects as the API serves them): URL -> (worker, ready)."""
    found: dict[str, tuple[DiscoveredWorker, bool]] = {}
    for s in slices:
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name", "") == port_name), None)
        if port is None or s.get("addressType") not in ("IPv4", "IPv6"):
            continue
        labels = s.get("metadata", {}).get("labels") or {}
        for e in s.get("endpoints") or []:
            address = e["addresses"][0]  # an endpoint's addresses are fungible: the API says use the first
            host = f"[{address}]" if s["addressType"] == "IPv6" else address
            w = DiscoveredWorker(f"http://{host}:{port}", zone=e.get("zone", ""), role=labels.get(ROLE, "both"),
                                 model=labels.get(MODEL), variant=labels.get(VARIANT, ""))
            # an unset condition means "unknown", which the API asks consumers to take as ready
            ready = (e.get("conditions") or {}).get("ready") is not False
            if w.url in found:  # listed twice while the controller moves it between slices: ready if either says so
                ready = ready or found[w.url][1]
            found[w.url] = (w, ready)
    return found


class EndpointSliceWatch:
    """List + watch of the matching EndpointSlices on a thread; ``on_change`` gets every slice after each change."""

    def __init__(self, api: Any, namespace: str, selector: str, resync_s: float,
                 on_change: Callable[[list[dict[str, Any]]], None]) -> None:
        self.api, self.namespace, self.selector, self.resync_s = api, namespace, selector, resync_s
        self.on_change = on_change
        self.slices: dict[str, dict[str, Any]] = {}
        self.stopped = threading.Event()
        self._watch: Any = None

    def run(self) -> None:
        """Until :meth:`stop`: list, watch until the resync or an error, again (backing off after errors)."""
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self.stopped.is_set():
            try:
                started = time.monotonic()
                self._stream(self._list())
                if time.monotonic() - started > 1.0:
                    backoff = 0.5
                else:  # a watch the server ends at once (a proxy's idle timeout?): not a busy loop of lists
                    self.stopped.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
            except ApiException as e:
                if e.status != 410:  # 410 Gone: the version is too old, list again now
                    log.warning("EndpointSlice API: %s %s; listing again in %.1fs", e.status, e.reason, backoff)
                    self.stopped.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
            except Exception as e:  # noqa: BLE001 - a dropped connection, a bad answer: list again
                if not self.stopped.is_set():
                    log.warning("EndpointSlice watch: %r; listing again in %.1fs", e, backoff)
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def stop(self) -> None:
        self.stopped.set()
        if self._watch is not None:
            self._watch.stop()  # unblocks its read

    def _list(self) -> str:
        """Replace the slices with a fresh list; its resource version."""
        r = self.api.list_namespaced_endpoint_slice(self.namespace, label_selector=self.selector,
                                                    _preload_content=False, _request_timeout=30)
        body = json.loads(r.data)
        self.slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
        self.on_change(list(self.slices.values()))
        return body["metadata"]["resourceVersion"]

    def _stream(self, version: str) -> None:
        """Apply watch events from ``version`` until the server ends the watch at the resync time."""
        from kubernetes import watch

        self._watch = watch.Watch()
        # with a timeout the client does not resume a watch itself: the next round lists afresh
        events = self._watch.stream(self.api.list_namespaced_endpoint_slice, self.namespace,
                                    label_selector=self.selector, resource_version=version,
                                    timeout_seconds=max(1, int(self.resync_s)),
                                    _request_timeout=(10, self.resync_s + 30))
        try:
            for ev in events:
                if self.stopped.is_set():
                    return
                obj = ev["raw_object"]
                if ev["type"] in ("ADDED", "MODIFIED"):
                    self.slices[obj["metadata"]["name"]] = obj
                elif ev["type"] == "DELETED":
                    self.slices.pop(obj["metadata"]["name"], None)
                else:
                    continue
                self.on_change(list(self.slices.values()))
        finally:
            events.close()  # the connection goes now, not when the generator is collected


class KubernetesDiscovery:
    """Keeps a router's workers equal to the ready endpoints of the fleet's worker EndpointSlices."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, api: Any = None) -> None:
        self.cfg = cfg
        self.api = api if api is not None else discovery_api(cfg.kubeconfig)  # a kubernetes DiscoveryV1Api
        self.owned: set[str] = set()  # the workers this source added

    async def run(self, router: Router) -> None:
        """Watch and apply until cancelled (a background task of the router's app)."""
        loop, changed = asyncio.get_running_loop(), asyncio.Event()
        latest: dict[str, Any] = {}

        def on_change(slices: list[dict[str, Any]]) -> None:  # on the watch thread
            found = endpoints(slices, self.cfg.k8s_port)
            loop.call_soon_threadsafe(lambda: (latest.update(found=found), changed.set()))

        namespace = self.cfg.k8s_namespace or default_namespace()
        watch = EndpointSliceWatch(self.api, namespace, self.cfg.k8s_selector, self.cfg.k8s_resync_s, on_change)
        thread = threading.Thread(target=watch.run, name="k8s-endpointslices", daemon=True)
        thread.start()
        log.info("discovering workers: EndpointSlices %s in namespace %s", self.cfg.k8s_selector, namespace)
        try:
            while True:
                await changed.wait()
                changed.clear()
                try:
                    await self.apply(router, latest["found"])
                except Exception:  # noqa: BLE001 - one bad change must not end discovery; the next one retries
                    log.exception("applying the discovered workers failed")
        finally:
            watch.stop()
            await asyncio.to_thread(thread.join, 5.0)

    async def apply(self, router: Router, found: dict[str, tuple[DiscoveredWorker, bool]]) -> None:
        """Add the ready endpoints, drain the ones that stopped being ready, remove the ones that are gone."""
        # a pod that is not ready yet is not added: the router would only health-check it
        wanted = {w for w, ready in found.values() if ready or w.url in self.owned}
        before = self.owned
        self.owned = await reconcile(router, wanted, self.owned)
        for url in sorted(self.owned - before):
            log.info("worker %s discovered", url)
        for url in sorted(before - self.owned):
            log.info("worker %s gone: removed", url)
        for url in self.owned:
            w = router.worker(url)
            draining = not found[url][1]
            if draining != w.draining:
                log.info("worker %s %s", url, "not ready: draining" if draining else "ready again")
                w.draining = draining
