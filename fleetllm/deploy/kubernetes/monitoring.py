"""Prometheus operator scrape objects: the workers' pods directly, the router with ``federate=0``.

The router's ``/metrics`` re-exports every worker's series (one target per fleet, for a laptop); in a
cluster Prometheus scrapes each worker pod itself, so the router is asked for its own series only, and
nothing is counted twice. Every target carries the pod's ``fleetllm.io/unit`` label (as
``fleetllm_io_unit``): the autoscalers' queries select one unit's workers by it. Both endpoints need the
fleet's secret (workers answer only its holders), read from the same Secret as the pods.
"""

from __future__ import annotations

from typing import Any

from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.options import KubernetesOptions

API = "monitoring.coreos.com/v1"


def monitor_objects(opts: KubernetesOptions, workers: bool = True) -> list[dict[str, Any]]:
    """One ServiceMonitor or PodMonitor for the workers and one for the router (none with ``--monitor none``).

    ``workers=False`` (Ray mode: the workers are Ray actors, not pods of their own): the router only, with
    every worker's series re-exported."""
    if opts.monitor == "none":
        return []
    auth = {"type": "Bearer", "credentials": {"name": opts.worker_secret, "key": "secret"}}
    endpoint = {"port": names.HTTP, "path": "/metrics", "interval": "15s", "authorization": auth}
    if not workers:
        return [_monitor(opts, "router", endpoint)]
    return [_monitor(opts, "worker", endpoint), _monitor(opts, "router", {**endpoint, "params": {"federate": ["0"]}})]


def _monitor(opts: KubernetesOptions, component: str, endpoint: dict[str, Any]) -> dict[str, Any]:
    labels = names.fleet_labels(opts, component)
    spec: dict[str, Any] = {"selector": {"matchLabels": labels}, "podTargetLabels": [names.UNIT]}
    if opts.monitor == "servicemonitor":
        kind, spec["endpoints"] = "ServiceMonitor", [endpoint]
    else:
        kind, spec["podMetricsEndpoints"] = "PodMonitor", [endpoint]
    return {"apiVersion": API, "kind": kind,
            "metadata": {"name": f"{opts.name}-{component}s", "namespace": opts.namespace, "labels": labels},
            "spec": spec}
