"""Every pod the fleet runs, hardened alike (Kubernetes' ``restricted`` Pod Security Standard and more).

Applied to each rendered Deployment, StatefulSet and RayService pod template, whoever built it:

- pod and containers run as a non-root user (``--run-as-user``; its group owns the volumes), with
  ``seccompProfile: RuntimeDefault``, no privilege escalation, every capability dropped and a read-only
  root filesystem;
- what the processes write goes to volumes: ``/tmp`` (an emptyDir; ``HOME`` points there, so caches
  under ``~`` land in it too) beside the volumes a pod already has (model caches); a Ray node also gets
  a memory-backed ``/dev/shm`` for its object store;
- the Kubernetes API token is mounted only where a process talks to the API server: the router (it
  discovers worker pods from EndpointSlices) and a Ray head with KubeRay's autoscaler.
"""

from __future__ import annotations

from typing import Any

from fleetllm.deploy.kubernetes.options import KubernetesOptions

SCRATCH = "/tmp"
WORKLOADS = ("Deployment", "StatefulSet", "RayService")
CONTAINER_SECURITY = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a workload object (a RayService's head and worker groups)."""
    if doc["kind"] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    return [doc["spec"]["template"]] if doc["kind"] in WORKLOADS else []


def pod_security(opts: KubernetesOptions) -> dict[str, Any]:
    uid = opts.run_as_user
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def harden(template: dict[str, Any], opts: KubernetesOptions, api_token: bool, ray_node: bool = False) -> None:
    """Make one pod template run as the module's doc says (in place). ``api_token``: the pod's processes
    call the Kubernetes API; ``ray_node``: a Ray head or worker (a shared-memory object store)."""
    pod = template["spec"]
    pod["securityContext"] = pod_security(opts)
    pod["automountServiceAccountToken"] = api_token  # the fleet's ServiceAccounts mount none by default
    scratch = {"scratch": SCRATCH, **({"dshm": "/dev/shm"} if ray_node else {})}
    volumes = pod.setdefault("volumes", [])
    for name in scratch:
        volumes.append({"name": name, "emptyDir": {"medium": "Memory"} if name == "dshm" else {}})
    for c in pod["containers"]:
        c["securityContext"] = {**c.get("securityContext", {}), **CONTAINER_SECURITY}
        c.setdefault("volumeMounts", []).extend({"name": n, "mountPath": p} for n, p in scratch.items())
        env = c.setdefault("env", [])
        if not any(e["name"] == "HOME" for e in env):
            env.append({"name": "HOME", "value": SCRATCH})
