"""One unit's workers (a model, or one variant or P/D role of it): a Deployment or StatefulSet, a headless
Service the router discovers the pods through, and a PodDisruptionBudget.

- A pod's requests and limits are the model's per-copy ``resources``: ``cores`` (whole CPUs, limit equal to
  the request: the copy owns them), ``memory_gb`` (request = limit), ``accelerators`` (the extended resource
  ``--accelerator-resource``). A copy without ``cores`` shares its node's CPUs (one CPU requested, no limit).
- Probes: ``/health`` is liveness (a worker listens only once loaded, so a startup probe gives it the
  fleet's ``startup_timeout_s`` first), ``/ready`` readiness (warm, not draining). On SIGTERM a worker
  drains (``/ready`` 503, in-flight requests finish): the grace period is longer than the drain.
- Models pulled from ``hf://`` or ``s3://`` run as a StatefulSet: each pod keeps its model cache on its
  own volume, so a restarted or rescheduled pod does not download the weights again. Others (an alias, a
  path inside the image) run as a Deployment with a scratch cache.
- Copies spread over zones (``topology.kubernetes.io/zone``) and nodes; a model's ``zones`` restrict
  its pods to those zones.
- A unit's pods run as its own ServiceAccount (:mod:`.identity`: the model's cloud role). A gated model's
  hub token is a file from a Secret (``--token-file``), never an environment variable: only this model's
  pods mount it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fleetllm.cli_options import to_argv
from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.errors import UsageError
from fleetllm.fleet.config import FleetConfig, ModelSpec
from fleetllm.router.state_url import AUTO
from fleetllm.server.worker_secret import ENV as SECRET_ENV
from fleetllm.store.pin import token_envs

CACHE_DIR = "/var/cache/fleetllm"
TOKENS_DIR = "/etc/fleetllm/model-token"
SECRET_FILE_MODE = 0o440  # a secret's files: read by the pod's user (the volume's group is its fsGroup), no one else
ZONE_KEY = "topology.kubernetes.io/zone"


def worker_port(cfg: FleetConfig) -> int:
    return cfg.worker_port or cfg.port + 1


def stateful(m: ModelSpec) -> bool:
    """Whether the unit's pods keep a model cache of their own (weights pulled from a store)."""
    return m.source.startswith(("hf://", "s3://"))


def worker_objects(cfg: FleetConfig, m: ModelSpec, opts: KubernetesOptions) -> list[dict[str, Any]]:
    """The unit's Service, workload and PodDisruptionBudget."""
    name, selector = names.unit_name(opts, m), names.unit_selector(opts, m)
    meta = {"name": name, "namespace": opts.namespace, "labels": names.unit_labels(opts, m)}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"clusterIP": "None", "selector": selector,
                        "ports": [{"name": names.HTTP, "port": worker_port(cfg), "targetPort": names.HTTP}]}}
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
           # one copy at a time: a node drain proceeds even for a one-copy model, never takes two at once
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}
    return [service, workload(cfg, m, opts), pdb]


def workload(cfg: FleetConfig, m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    """The unit's Deployment, or StatefulSet with a cache volume per pod (see the module's doc)."""
    name, labels = names.unit_name(opts, m), names.unit_labels(opts, m)
    template = {"metadata": {"labels": labels}, "spec": pod_spec(cfg, m, opts)}
    spec: dict[str, Any] = {"replicas": m.replicas.initial,
                            "selector": {"matchLabels": names.unit_selector(opts, m)}, "template": template}
    meta = {"name": name, "namespace": opts.namespace, "labels": labels}
    if not stateful(m):
        template["spec"].setdefault("volumes", []).append({"name": "model-cache", "emptyDir": {}})
        # a new copy first, then an old one goes: the model never runs below its count during a rollout
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}
    claim = {"metadata": {"name": "model-cache"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": opts.cache_size}}}}
    spec.update(serviceName=name, podManagementPolicy="Parallel", volumeClaimTemplates=[claim],
                # a scaled-down copy's cache stays for the next scale-up
                persistentVolumeClaimRetentionPolicy={"whenScaled": "Retain", "whenDeleted": "Delete"})
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": spec}


def pod_spec(cfg: FleetConfig, m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    selector = {"matchLabels": names.unit_selector(opts, m)}
    spread = [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": selector}
              for key in (ZONE_KEY, "kubernetes.io/hostname")]
    spec: dict[str, Any] = {"serviceAccountName": names.unit_name(opts, m),
                            "terminationGracePeriodSeconds": opts.grace_period_s, "enableServiceLinks": False,
                            "containers": [container(cfg, m, opts)], "topologySpreadConstraints": spread}
    tokens = token_envs(m.engine)
    if tokens:  # this model's key of the hub-token Secret, as a file
        spec["volumes"] = [{"name": "model-token", "secret": {"secretName": f"{opts.name}-model-tokens",
                                                              "items": [{"key": v, "path": v} for v in tokens],
                                                              "defaultMode": SECRET_FILE_MODE}}]
    if m.zones:
        term = {"matchExpressions": [{"key": ZONE_KEY, "operator": "In", "values": list(m.zones)}]}
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                                             {"nodeSelectorTerms": [term]}}}
    return spec


def container(cfg: FleetConfig, m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    port = worker_port(cfg)
    probe = {"httpGet": {"path": "/health", "port": names.HTTP}, "timeoutSeconds": 3}
    mounts = [{"name": "model-cache", "mountPath": CACHE_DIR}]
    if token_envs(m.engine):
        mounts.append({"name": "model-token", "mountPath": TOKENS_DIR, "readOnly": True})
    return {
        "name": "worker", "image": opts.image, "command": ["fleetllm"], "args": worker_args(cfg, m, opts),
        "ports": [{"name": names.HTTP, "containerPort": port, "protocol": "TCP"}],
        "env": worker_env(m, opts), "resources": resources(m, opts), "volumeMounts": mounts,
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": math.ceil(cfg.startup_timeout_s / 5)},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": names.HTTP}, "timeoutSeconds": 2,
                           "periodSeconds": 5, "failureThreshold": 1},
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def worker_args(cfg: FleetConfig, m: ModelSpec, opts: KubernetesOptions) -> list[str]:
    """``fleetllm worker`` flags of one copy; its metric label ``worker`` is the pod's name."""
    engine = dict(m.engine)
    if engine.get("kv_remote") == AUTO:
        raise UsageError(f"model {m.served_name!r}: engine: {{kv_remote: auto}} starts a redis-server beside "
                         "`fleetllm serve`; in Kubernetes give the redis://HOST:PORT of a Redis the cluster runs")
    var = engine.pop("token_env", None)
    if var:  # the token's file where the pod mounts it, in place of the variable
        engine["token_file"] = f"{TOKENS_DIR}/{var}"
    args = ["worker", *(["--simulate"] if m.simulate else []), "--model", m.source,
            "--served-model-name", m.served_name, *dataclasses.replace(m, engine=engine).worker_args()]
    if m.resources.cores and not m.simulate and "num_threads" not in m.engine:
        args += ["--num-threads", str(m.resources.cores)]
    args += ["--host", "0.0.0.0", "--port", str(worker_port(cfg)), "--role", m.role, "--worker-id", "$(POD_NAME)",
             "--drain-timeout", f"{opts.drain_timeout_s:g}"]
    if cfg.otlp_endpoint:
        args += ["--otlp-endpoint", cfg.otlp_endpoint]
    return args + to_argv(cfg.capture)


def worker_env(m: ModelSpec, opts: KubernetesOptions) -> list[dict[str, Any]]:
    return [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            secret_env(SECRET_ENV, opts.worker_secret, "secret"),
            {"name": "FLEETLLM_CACHE_DIR", "value": CACHE_DIR}, {"name": "HF_HOME", "value": f"{CACHE_DIR}/hf"}]


def secret_env(var: str, secret: str | None, key: str) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def resources(m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    r = m.resources
    memory = f"{max(1, round((r.memory_gb or 0) * 1024))}Mi"
    requests: dict[str, Any] = {"cpu": str(r.cores) if r.cores else ("100m" if m.simulate else "1"), "memory": memory}
    limits: dict[str, Any] = {"memory": memory}
    if r.cores:
        limits["cpu"] = str(r.cores)
    if r.accelerators:
        requests[opts.accelerator_resource] = limits[opts.accelerator_resource] = r.accelerators
    return {"requests": requests, "limits": limits}
