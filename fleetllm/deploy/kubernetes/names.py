"""Object names and labels: one fleet's objects, its router, and each unit's (model, variant, P/D role) workers.

Names are DNS labels (RFC 1035: lowercase letters, digits, '-'); a unit whose name does not map onto one
without loss (``coder@canary``, ``org/Model``) gets a short hash of its real name, so two units never share
objects. Worker Services carry ``fleetllm.io/model``, ``fleetllm.io/variant`` and ``fleetllm.io/role``; the
EndpointSlice controller copies a Service's labels onto its slices, which is how the router's discovery
(:mod:`fleetllm.router.discovery.kubernetes`) learns them.
"""

from __future__ import annotations

import hashlib
import re

from fleetllm.deploy.kubernetes.options import MAX_NAME, MAX_OBJECT_NAME, KubernetesOptions
from fleetllm.fleet.config import ModelSpec

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
UNIT = "fleetllm.io/unit"
MODEL = "fleetllm.io/model"
VARIANT = "fleetllm.io/variant"
ROLE = "fleetllm.io/role"
HTTP = "http"  # the port name of every fleetllm container and Service

_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def label_value_ok(value: str) -> bool:
    return len(value) <= 63 and _LABEL_VALUE.fullmatch(value) is not None


def slug(text: str, room: int) -> str:
    """``text`` as a DNS label of at most ``room`` characters; lossy mappings end with a hash of ``text``."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"
    if s == text and len(s) <= room:
        return s
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    return f"{s[:room - 7].rstrip('-')}-{digest}"


def _unit_text(m: ModelSpec) -> str:
    return "-".join(p for p in (m.served_name, m.variant, "" if m.role == "both" else m.role) if p)


def unit_slug(m: ModelSpec) -> str:
    """The unit as a label value: ``coder-canary``, ``smollm2-prefill``."""
    return slug(_unit_text(m), MAX_NAME)


def unit_name(opts: KubernetesOptions, m: ModelSpec) -> str:
    """The unit's Deployment / StatefulSet, Service, PodDisruptionBudget and scaler name."""
    return f"{opts.name}-{slug(_unit_text(m), MAX_OBJECT_NAME - len(opts.name) - 1)}"


def fleet_labels(opts: KubernetesOptions, component: str) -> dict[str, str]:
    return {NAME: "fleetllm", INSTANCE: opts.name, COMPONENT: component}


def unit_selector(opts: KubernetesOptions, m: ModelSpec) -> dict[str, str]:
    """The labels that pick one unit's pods (stable across edits of everything else)."""
    return {**fleet_labels(opts, "worker"), UNIT: unit_slug(m)}


def unit_labels(opts: KubernetesOptions, m: ModelSpec) -> dict[str, str]:
    """The selector plus what the router reads from the EndpointSlices: model, variant, role.

    A served name that is no label value (``org/name``) is left out: the worker says its model itself in
    its KV-event snapshot, which the router waits for before routing that model's requests there."""
    labels = {**unit_selector(opts, m), ROLE: m.role}
    if label_value_ok(m.served_name):
        labels[MODEL] = m.served_name
    if m.variant:
        if not label_value_ok(m.variant):
            raise ValueError(f"model {m.served_name!r}: variant {m.variant!r} must be a Kubernetes label value "
                             "(letters, digits, '-', '_', '.', at most 63): the router reads it from a label")
        labels[VARIANT] = m.variant
    return labels


def worker_selector(opts: KubernetesOptions) -> str:
    """The label selector of the fleet's worker EndpointSlices (the router's ``--k8s-selector``)."""
    return ",".join(f"{k}={v}" for k, v in fleet_labels(opts, "worker").items())
