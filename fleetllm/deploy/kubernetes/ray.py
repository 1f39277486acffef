"""KubeRay mode (``--ray``): a RayService whose cluster runs the workers as Ray actors, and the fleet
controller (``fleetllm serve --ray``) as a Deployment that drives it.

The RayService holds the Ray cluster: a head that runs no copies (``num-cpus: 0``) and one worker group
per unit, each Ray node sized for one copy (the model's per-copy resources), between the unit's ``min``
and ``max``; with any autoscaled unit, KubeRay's in-tree autoscaler adds Ray nodes when copies wait for
room. fleetllm's Ray mode places its own actors (no Ray Serve application), so the RayService carries no
``serveConfigV2``. The controller reads the fleet config from the ConfigMap and reaches the cluster
through the RayService's head Service (Ray Client, port 10001); its router finds the workers through Ray.

Ray's token authentication is on (``RAY_AUTH_MODE=token``, Ray >= 2.52): every Ray node and the controller
read the token from a Secret mounted as a file (``RAY_AUTH_TOKEN_PATH``), and Ray refuses any GCS, raylet,
Ray Client or dashboard call without it. The dashboard listens on the head's loopback only (reach it
with ``kubectl port-forward``).
"""

from __future__ import annotations

from typing import Any

from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.deploy.kubernetes.router import (
    ADMIN_TOKEN_ARGS,
    CONFIG_DIR,
    KEYS_DIR,
    RESOURCES,
    admin_token_volume,
    router_name,
)
from fleetllm.deploy.kubernetes.workers import SECRET_FILE_MODE, resources, secret_env
from fleetllm.fleet.config import FleetConfig, ModelSpec
from fleetllm.server.worker_secret import ENV as SECRET_ENV

RAY_VERSION = "2.60.0"  # pyproject's pin
CLIENT_PORT = 10001
RAY_TOKEN_DIR = "/etc/fleetllm/ray-token"
RAY_TOKEN_KEY = "auth_token"


def ray_token_secret(opts: KubernetesOptions) -> str:
    return f"{opts.name}-ray-token"


def with_ray_token(pod: dict[str, Any], opts: KubernetesOptions) -> dict[str, Any]:
    """``pod`` (a pod spec) with Ray's token authentication on in every container, the token as a file."""
    pod.setdefault("volumes", []).append({"name": "ray-token", "secret": {"secretName": ray_token_secret(opts),
                                                                          "defaultMode": SECRET_FILE_MODE}})
    for c in pod["containers"]:
        c.setdefault("env", []).extend([{"name": "RAY_AUTH_MODE", "value": "token"},
                                        {"name": "RAY_AUTH_TOKEN_PATH", "value": f"{RAY_TOKEN_DIR}/{RAY_TOKEN_KEY}"}])
        c.setdefault("volumeMounts", []).append({"name": "ray-token", "mountPath": RAY_TOKEN_DIR, "readOnly": True})
    return pod


def ray_address(opts: KubernetesOptions) -> str:
    """Ray Client address of the RayService's head (KubeRay names its head Service NAME-head-svc)."""
    return f"ray://{opts.name}-head-svc.{opts.namespace}.svc:{CLIENT_PORT}"


def ray_service(cfg: FleetConfig, opts: KubernetesOptions) -> dict[str, Any]:
    head_ports = [{"name": "gcs", "containerPort": 6379}, {"name": "client", "containerPort": CLIENT_PORT},
                  {"name": "dashboard", "containerPort": 8265}]
    head_pod = {"containers": [{"name": "ray-head", "image": opts.image, "ports": head_ports,
                                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}}]}
    head = {"rayStartParams": {"num-cpus": "0", "dashboard-host": "127.0.0.1"},
            "template": {"metadata": {"labels": names.fleet_labels(opts, "ray-head")},
                         "spec": with_ray_token(head_pod, opts)}}
    cluster = {"rayVersion": RAY_VERSION, "enableInTreeAutoscaling": any(m.autoscaled for m in cfg.models),
               "headGroupSpec": head, "workerGroupSpecs": [worker_group(m, opts) for m in cfg.models]}
    return {"apiVersion": "ray.io/v1", "kind": "RayService",
            "metadata": {"name": opts.name, "namespace": opts.namespace, "labels": names.fleet_labels(opts, "ray")},
            "spec": {"rayClusterConfig": cluster}}


def worker_group(m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    """Ray nodes for one unit's copies, each sized for one copy."""
    res = resources(m, opts)
    params = {"num-cpus": str(m.resources.cores or 1)}
    if m.resources.accelerators:
        params["num-gpus"] = str(m.resources.accelerators)
    pod = {"serviceAccountName": names.unit_name(opts, m),  # the model's cloud role (:mod:`.identity`)
           "containers": [{"name": "ray-worker", "image": opts.image, "resources": res}],
           "terminationGracePeriodSeconds": opts.grace_period_s}
    return {"groupName": names.unit_slug(m), "replicas": m.replicas.initial, "minReplicas": m.replicas.min,
            "maxReplicas": m.replicas.max, "rayStartParams": params,
            # not the plain mode's worker labels: these pods are Ray nodes, whatever actors they end up holding
            "template": {"metadata": {"labels": {**names.fleet_labels(opts, "ray-worker"),
                                                 names.UNIT: names.unit_slug(m)}}, "spec": with_ray_token(pod, opts)}}


def controller_deployment(cfg: FleetConfig, opts: KubernetesOptions) -> dict[str, Any]:
    """``fleetllm serve --config fleet.yaml --ray ADDRESS``: the fleet controller and its router, one pod."""
    labels = names.fleet_labels(opts, "router")
    mount, volume = admin_token_volume(opts)
    mounts = [{"name": "fleet", "mountPath": CONFIG_DIR, "readOnly": True}, mount]
    volumes = [{"name": "fleet", "configMap": {"name": f"{opts.name}-fleet"}}, volume]
    if cfg.keys_file:
        mounts.append({"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True})
        volumes.append({"name": "api-keys", "secret": {"secretName": f"{opts.name}-api-keys"}})
    args = ["serve", "--config", f"{CONFIG_DIR}/fleet.yaml", "--ray", ray_address(opts), "--host", "0.0.0.0",
            "--port", str(cfg.port), *ADMIN_TOKEN_ARGS]
    tcp = {"tcpSocket": {"port": names.HTTP}, "periodSeconds": 5}
    container = {"name": "controller", "image": opts.image, "command": ["fleetllm"], "args": args,
                 "ports": [{"name": names.HTTP, "containerPort": cfg.port, "protocol": "TCP"}],
                 "env": [secret_env(SECRET_ENV, opts.worker_secret, "secret")], "resources": RESOURCES,
                 "volumeMounts": mounts, "readinessProbe": {**tcp, "failureThreshold": 1},
                 "livenessProbe": {**tcp, "failureThreshold": 3}}
    pod = {"serviceAccountName": router_name(opts), "containers": [container], "volumes": volumes,
           "enableServiceLinks": False, "terminationGracePeriodSeconds": opts.grace_period_s}
    with_ray_token(pod, opts)
    # one controller: two would each start the fleet's actors
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": router_name(opts), "namespace": opts.namespace, "labels": labels},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}
