"""NetworkPolicies: who may open a connection to which of the fleet's pods (ingress only; egress is free,
models come from hubs and buckets).

- the router (or Ray mode's controller) takes its API port from anywhere: clients, the Ingress
  controller, Prometheus; it checks credentials itself;
- a model's workers (one policy per served model) take their port from the router, from the model's
  other workers (P/D peers: a decode worker reads KV from a prefill worker, any copy may prefill for
  another with ``pd_threshold: auto``) and from Prometheus's namespace (``--monitoring-namespace``),
  nothing else: another model's workers cannot reach them;
- Ray's head and worker nodes take any port (GCS, raylets, object transfers, Ray Client) only from the
  fleet's own pods.

A pod a policy selects refuses every connection the policy does not allow (kubelet probes excepted).
"""

from __future__ import annotations

from typing import Any

from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.options import MAX_OBJECT_NAME, KubernetesOptions
from fleetllm.fleet.config import FleetConfig

API = "networking.k8s.io/v1"
_HTTP = [{"protocol": "TCP", "port": names.HTTP}]


def network_policies(cfg: FleetConfig, opts: KubernetesOptions) -> list[dict[str, Any]]:
    """The router's policy, and each model's workers' (plain mode) or the Ray nodes' (Ray mode)."""
    router = _policy(opts, "router", {"matchLabels": names.fleet_labels(opts, "router")}, [{"ports": _HTTP}])
    if opts.ray:
        nodes = {"matchLabels": {names.INSTANCE: opts.name},
                 "matchExpressions": [{"key": names.COMPONENT, "operator": "In", "values": ["ray-head", "ray-worker"]}]}
        fleet = {"podSelector": {"matchLabels": {names.NAME: "fleetllm", names.INSTANCE: opts.name}}}
        return [router, _policy(opts, "ray", nodes, [{"from": [fleet]}])]
    policies = [router]
    for model in dict.fromkeys(m.served_name for m in cfg.models):
        units = {"matchLabels": names.fleet_labels(opts, "worker"), "matchExpressions": [
            {"key": names.UNIT, "operator": "In",
             "values": [names.unit_slug(m) for m in cfg.models if m.served_name == model]}]}
        sources = [{"podSelector": {"matchLabels": names.fleet_labels(opts, "router")}}, {"podSelector": units},
                   {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": opts.monitoring_namespace}}}]
        what = "workers-" + names.slug(model, MAX_OBJECT_NAME - len(opts.name) - len("-workers-"))
        policies.append(_policy(opts, what, units, [{"from": sources, "ports": _HTTP}]))
    return policies


def _policy(opts: KubernetesOptions, what: str, pods: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "NetworkPolicy",
            "metadata": {"name": f"{opts.name}-{what}", "namespace": opts.namespace,
                         "labels": names.fleet_labels(opts, "network")},
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": rules}}
