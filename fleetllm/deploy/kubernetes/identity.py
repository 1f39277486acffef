"""ServiceAccounts: one per unit, so each model's pods act as the cloud role its ``identity:`` names.

With ``identity: {aws_role_arn: ...}`` the account carries EKS IRSA's ``eks.amazonaws.com/role-arn``
annotation (the EKS webhook then gives the pods a web-identity token for that role); with
``pod_identity: true`` it carries none, and an EKS Pod Identity association (``aws eks
create-pod-identity-association``, listed in the output's README.md) ties the account to the role. Either
way the token comes through a volume of its own: the Kubernetes API token is not mounted by default.
"""

from __future__ import annotations

from typing import Any

from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.fleet.cluster import Identity
from fleetllm.fleet.config import FleetConfig


def service_account(meta: dict[str, Any], identity: Identity | None) -> dict[str, Any]:
    """A ServiceAccount named and labelled by ``meta``, annotated for ``identity`` (no API token mounted)."""
    metadata = dict(meta)
    if identity is not None and identity.annotations:
        metadata["annotations"] = identity.annotations
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata, "automountServiceAccountToken": False}


def unit_accounts(cfg: FleetConfig, opts: KubernetesOptions) -> list[dict[str, Any]]:
    """Every unit's ServiceAccount (its pods' ``serviceAccountName`` is the unit's name)."""
    return [service_account({"name": names.unit_name(opts, m), "namespace": opts.namespace,
                             "labels": names.unit_labels(opts, m)}, m.identity) for m in cfg.models]


def pod_identity_lines(cfg: FleetConfig, opts: KubernetesOptions, router: str) -> list[str]:
    """README lines: the EKS Pod Identity associations to create (none when no identity asks for one)."""
    pairs = [(router, cfg.identity)] + [(names.unit_name(opts, m), m.identity) for m in cfg.models]
    wanted = [(sa, i) for sa, i in pairs if i is not None and i.pod_identity]
    if not wanted:
        return []
    lines = ["", "EKS Pod Identity: associate each ServiceAccount with its role (once per cluster):", ""]
    lines += [f"    aws eks create-pod-identity-association --cluster-name CLUSTER --namespace {opts.namespace} "
              f"--service-account {sa} --role-arn {i.aws_role_arn}" for sa, i in wanted]
    return lines
