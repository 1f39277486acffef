"""All of a fleet's manifests, and the directory ``fleetllm deploy kubernetes`` writes them to.

Plain mode: ConfigMap, router (RBAC, Deployment, Service), per unit a Service, workload and
PodDisruptionBudget, the Prometheus operator monitors, per autoscaled unit a ScaledObject or HPA. Ray
mode: ConfigMap, RayService, the controller's Deployment and Service, the router's monitor. Both: a
ServiceAccount per unit (:mod:`.identity`), the router's Ingress when the fleet has a ``domain:``
(:mod:`.ingress`), NetworkPolicies (:mod:`.network`), and every pod hardened (:mod:`.security`).
Secrets are referenced, never written: the directory's README.md says which to create.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.identity import pod_identity_lines, service_account, unit_accounts
from fleetllm.deploy.kubernetes.ingress import ingress_objects
from fleetllm.deploy.kubernetes.monitoring import monitor_objects
from fleetllm.deploy.kubernetes.network import network_policies
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.deploy.kubernetes.ray import RAY_TOKEN_KEY, controller_deployment, ray_service, ray_token_secret
from fleetllm.deploy.kubernetes.router import fleet_config_map, router_name, router_objects, router_service
from fleetllm.deploy.kubernetes.scaling import scaler_objects
from fleetllm.deploy.kubernetes.security import harden, pod_templates
from fleetllm.deploy.kubernetes.workers import worker_objects
from fleetllm.fleet.config import FleetConfig
from fleetllm.store.pin import token_envs


def render(cfg: FleetConfig, opts: KubernetesOptions) -> dict[str, list[dict[str, Any]]]:
    """The fleet's objects by file name, numbered in apply order (``kubectl apply -f`` takes a directory's
    files by name): ``00-config.yaml``, ``10-router.yaml``, ``20-worker-<unit>.yaml``, ...."""
    units = [names.unit_name(opts, m) for m in cfg.models]
    dup = next((u for u in units if units.count(u) > 1), None)
    if dup is not None:
        raise ValueError(f"two models map onto the object name {dup!r}: rename one")
    files: dict[str, list[dict[str, Any]]] = {"00-config.yaml": [fleet_config_map(cfg, opts)],
                                              "05-service-accounts.yaml": unit_accounts(cfg, opts),
                                              "15-ingress.yaml": ingress_objects(cfg, opts, router_name(opts)),
                                              "50-network-policies.yaml": network_policies(cfg, opts)}
    if opts.ray:
        labels = names.fleet_labels(opts, "router")
        files["05-service-accounts.yaml"].insert(0, service_account(
            {"name": router_name(opts), "namespace": opts.namespace, "labels": labels}, cfg.identity))
        files["10-ray.yaml"] = [ray_service(cfg, opts), controller_deployment(cfg, opts),
                                router_service(cfg, opts, labels)]
        files["30-monitoring.yaml"] = monitor_objects(opts, workers=False)
    else:
        files["10-router.yaml"] = router_objects(cfg, opts)
        for m, unit in zip(cfg.models, units, strict=True):
            files[f"20-worker-{unit.removeprefix(opts.name + '-')}.yaml"] = worker_objects(cfg, m, opts)
        files["30-monitoring.yaml"] = monitor_objects(opts, workers=True)
        files["40-autoscaling.yaml"] = scaler_objects(cfg.models, opts)
    autoscaled_ray = opts.ray and any(m.autoscaled for m in cfg.models)
    for doc in (d for docs in files.values() for d in docs):
        for template in pod_templates(doc):
            component = template["metadata"]["labels"][names.COMPONENT]
            # the API server is called by the router's discovery and by KubeRay's autoscaler in the head
            token = (component == "router" and not opts.ray) or (component == "ray-head" and autoscaled_ray)
            harden(template, opts, api_token=token, ray_node=component.startswith("ray-"))
    return {name: docs for name, docs in sorted(files.items()) if docs}


class _Dumper(yaml.SafeDumper):
    """No anchors and aliases: objects sharing a label dict are written out in full, as people write them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(docs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def kubernetes_manifests(cfg: FleetConfig, **options: Any) -> list[dict[str, Any]]:
    """Every object of the fleet, in apply order; ``options`` are :class:`KubernetesOptions` fields.

    What ``fleetllm recommend`` calls for its top choice:
    ``kubernetes_manifests(FleetConfig.from_dict(fleet_dict(...)), namespace="llm", image="...")``."""
    return [doc for docs in render(cfg, KubernetesOptions(**options)).values() for doc in docs]


def write(cfg: FleetConfig, opts: KubernetesOptions, out: str | Path) -> list[Path]:
    """Write the manifests (one multi-document YAML per file of :func:`render`) and README.md into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, docs in render(cfg, opts).items():
        path = out / name
        path.write_text(to_yaml(docs))
        paths.append(path)
    readme = out / "README.md"
    readme.write_text(secrets_readme(cfg, opts))
    return [*paths, readme]


def secrets_readme(cfg: FleetConfig, opts: KubernetesOptions) -> str:
    """What to create before ``kubectl apply -f``: the Secrets the manifests reference."""
    ns = opts.namespace
    lines = [f"# fleet {opts.name}: Secrets to create first (namespace {ns})", "",
             "The router and workers share a random secret (workers answer only the router; Prometheus reads",
             "`/metrics` with it):", "",
             f"    kubectl -n {ns} create secret generic {opts.worker_secret} "
             "--from-literal=secret=\"$(openssl rand -base64 32)\"", "",
             "The admin token (`Authorization: Bearer` for `/admin/*` and `/router/state`; keep it with the",
             "operators, never in a worker):", "",
             f"    kubectl -n {ns} create secret generic {opts.name}-admin-token "
             "--from-literal=token=\"$(openssl rand -base64 32)\""]
    if cfg.keys_file:
        lines += ["", "API keys (`fleetllm keys create --file keys.yaml ...`; re-apply after every change):", "",
                  f"    kubectl -n {ns} create secret generic {opts.name}-api-keys --from-file=keys.yaml="
                  f"{cfg.keys_file} --dry-run=client -o yaml | kubectl apply -f -"]
    if opts.ray:
        lines += ["", "Ray's token (every Ray node and the controller authenticate with it):", "",
                  f"    kubectl -n {ns} create secret generic {ray_token_secret(opts)} "
                  f"--from-literal={RAY_TOKEN_KEY}=\"$(openssl rand -hex 32)\""]
    tokens = sorted({v for m in cfg.models for v in token_envs(m.engine)})
    if tokens:
        lines += ["", "Hub tokens of gated models:", "",
                  f"    kubectl -n {ns} create secret generic {opts.name}-model-tokens "
                  + " ".join(f"--from-literal={v}=\"${v}\"" for v in tokens)]
    lines += pod_identity_lines(cfg, opts, router_name(opts))
    lines += ["", "Then: `kubectl apply -f .`", ""]
    return "\n".join(lines)
