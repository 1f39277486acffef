"""The router: a Deployment that finds the workers itself (EndpointSlices), its Service, the RBAC that lets
it list and watch EndpointSlices, and the fleet config as a ConfigMap.

The router's probes are TCP checks, not ``/health``: ``/health`` answers 503 while no worker is ready,
and a router must stay up then (a scale-from-zero model's requests wait in it while a copy starts).
With ``keys_file`` in the fleet, the keys file comes from a Secret mounted as a directory (the router
re-reads the file when the Secret changes). Router and workers share the fleet's secret
(``FLEETLLM_WORKER_SECRET`` from a Secret): workers answer only the router (and Prometheus, which scrapes
``/metrics`` with it). The admin endpoints take the admin token, another Secret mounted as a file
(``--admin-token-file``): never the workers' secret.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

import yaml

from fleetllm.cli_options import to_argv
from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.identity import service_account
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.deploy.kubernetes.workers import SECRET_FILE_MODE, secret_env
from fleetllm.errors import UsageError
from fleetllm.fleet.config import FleetConfig
from fleetllm.fleet.router_args import model_router_args
from fleetllm.router.state_url import AUTO, redact
from fleetllm.server.worker_secret import ENV as SECRET_ENV

KEYS_DIR = "/etc/fleetllm/keys"
ADMIN_DIR = "/etc/fleetllm/admin"
CONFIG_DIR = "/etc/fleetllm"
RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


def router_name(opts: KubernetesOptions) -> str:
    return f"{opts.name}-router"


def router_objects(cfg: FleetConfig, opts: KubernetesOptions) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, Deployment and Service of the router."""
    name, labels = router_name(opts), names.fleet_labels(opts, "router")
    meta = {"name": name, "namespace": opts.namespace, "labels": labels}
    rule = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": opts.namespace}]}
    return [service_account(meta, cfg.identity),
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [rule]},
            binding, router_deployment(cfg, opts), router_service(cfg, opts, labels)]


def router_service(cfg: FleetConfig, opts: KubernetesOptions, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": router_name(opts), "namespace": opts.namespace, "labels": labels},
            "spec": {"type": "ClusterIP", "selector": labels,
                     "ports": [{"name": names.HTTP, "port": cfg.port, "targetPort": names.HTTP}]}}


def admin_token_volume(opts: KubernetesOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mount and volume of the admin token's Secret (key ``token``), read by ``--admin-token-file``."""
    return ({"name": "admin-token", "mountPath": ADMIN_DIR, "readOnly": True},
            {"name": "admin-token", "secret": {"secretName": f"{opts.name}-admin-token",
                                                "defaultMode": SECRET_FILE_MODE}})


ADMIN_TOKEN_ARGS = ["--admin-token-file", f"{ADMIN_DIR}/token"]


def router_deployment(cfg: FleetConfig, opts: KubernetesOptions) -> dict[str, Any]:
    labels = names.fleet_labels(opts, "router")
    tcp = {"tcpSocket": {"port": names.HTTP}, "periodSeconds": 5}
    mount, volume = admin_token_volume(opts)
    mounts = [{"name": "hf-cache", "mountPath": "/var/cache/fleetllm"}, mount]
    volumes = [{"name": "hf-cache", "emptyDir": {}}, volume]
    if cfg.keys_file:
        mounts.append({"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True})
        volumes.append({"name": "api-keys", "secret": {"secretName": f"{opts.name}-api-keys"}})
    container = {"name": "router", "image": opts.image, "command": ["fleetllm"], "args": router_args(cfg, opts),
                 "ports": [{"name": names.HTTP, "containerPort": cfg.port, "protocol": "TCP"}],
                 "env": [secret_env(SECRET_ENV, opts.worker_secret, "secret"),
                         {"name": "HF_HOME", "value": "/var/cache/fleetllm/hf"}],  # the models' tokenizers
                 "resources": RESOURCES, "volumeMounts": mounts, "livenessProbe": {**tcp, "failureThreshold": 3},
                 "readinessProbe": {**tcp, "failureThreshold": 1},
                 "securityContext": {"allowPrivilegeEscalation": False}}
    pod = {"serviceAccountName": router_name(opts), "containers": [container], "volumes": volumes,
           "enableServiceLinks": False, "terminationGracePeriodSeconds": opts.grace_period_s}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": router_name(opts), "namespace": opts.namespace, "labels": labels},
            "spec": {"replicas": opts.router_replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def router_args(cfg: FleetConfig, opts: KubernetesOptions) -> list[str]:
    """``fleetllm router`` flags: discovery of this fleet's worker pods, then the models' settings."""
    args = ["router", "--discover", "kubernetes", "--k8s-namespace", opts.namespace,
            "--k8s-selector", names.worker_selector(opts), "--policy", cfg.policy, "--host", "0.0.0.0",
            "--port", str(cfg.port), *ADMIN_TOKEN_ARGS, *model_router_args(cfg)]
    if cfg.external:  # workers run outside the cluster's pods: given by hand, never removed by discovery
        args += ["--workers", ",".join(cfg.external)]
    if cfg.pd_threshold is not None:
        args += ["--pd-threshold", str(cfg.pd_threshold)]
    if cfg.keys_file:
        args += ["--keys-file", f"{KEYS_DIR}/keys.yaml"]
    if cfg.state_url:
        args += ["--state-url", cluster_state_url(cfg.state_url)]
    if cfg.otlp_endpoint:
        args += ["--otlp-endpoint", cfg.otlp_endpoint]
    return args + to_argv(cfg.capture) + cfg.router_args


def cluster_state_url(url: str) -> str:
    """The fleet's ``state_url`` as the router pods take it: a Redis the cluster runs (``auto`` starts one beside
    ``fleetllm serve`` only), with no password (a manifest's arguments are no place for a secret)."""
    if url == AUTO:
        raise UsageError("state_url: auto starts a redis-server beside `fleetllm serve`; in Kubernetes give the "
                         "redis://HOST:PORT of a Redis the cluster runs")
    if urlsplit(url).password:
        raise UsageError(f"state_url {redact(url)}: a password would be written into the router's manifest; "
                         "use a Redis reachable without one from the router pods (NetworkPolicy)")
    return url


def fleet_config_map(cfg: FleetConfig, opts: KubernetesOptions) -> dict[str, Any]:
    """The fleet config as the cluster runs it: ``machines`` dropped (the cluster's nodes replace them), the
    keys file at its mounted path. ``FleetConfig.from_dict`` reads it back."""
    doc = dataclasses.asdict(cfg)
    doc.pop("machines")
    if cfg.keys_file:
        doc["keys_file"] = f"{KEYS_DIR}/keys.yaml"
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{opts.name}-fleet", "namespace": opts.namespace,
                         "labels": names.fleet_labels(opts, "config")},
            "data": {"fleet.yaml": yaml.safe_dump(doc, sort_keys=False)}}
