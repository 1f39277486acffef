"""Per autoscaled unit, a KEDA ScaledObject or an HPA on the queue: ``vllm:num_requests_waiting`` per copy.

fleetllm's workers export vLLM's metric names, so the trigger is the one vLLM's production stack uses:
queued requests per copy against the model's ``autoscale.waiting_per_copy`` (5 by default), with the
model's ``up_window_s`` / ``down_window_s`` as the HPA's stabilisation windows and ``min``..``max`` as
its bounds. A model with ``min: 0`` scales from zero with KEDA: requests the router holds for it
(``fleetllm_router_held_requests``) activate the scaler while no copy exists. An HPA cannot go below
one copy (without the alpha HPAScaleToZero gate), so its minimum is at least 1, and it reads the metric
through prometheus-adapter as ``vllm_num_requests_waiting`` (the rule is in docs/scale-out.md (Kubernetes)).
Units with a fixed count (``min == max``) get no scaler.
"""

from __future__ import annotations

from typing import Any

from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.deploy.kubernetes.workers import stateful
from fleetllm.fleet.config import ModelSpec

ADAPTER_METRIC = "vllm_num_requests_waiting"


def scaler_objects(models: list[ModelSpec], opts: KubernetesOptions) -> list[dict[str, Any]]:
    make = {"keda": scaled_object, "hpa": hpa}.get(opts.autoscaler)
    return [make(m, opts) for m in models if m.autoscaled] if make else []


def queue_query(m: ModelSpec, opts: KubernetesOptions) -> str:
    """PromQL: the unit's queued requests, plus (scaled from zero) those the router holds for its model."""
    waiting = f'sum(vllm:num_requests_waiting{{namespace="{opts.namespace}",fleetllm_io_unit="{names.unit_slug(m)}"}})'
    if m.replicas.min > 0:
        return waiting
    held = f'sum(fleetllm_router_held_requests{{namespace="{opts.namespace}",model="{m.served_name}"}})'
    return f"({waiting} or vector(0)) + ({held} or vector(0))"


def _target(m: ModelSpec, opts: KubernetesOptions) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet" if stateful(m) else "Deployment",
            "name": names.unit_name(opts, m)}


def _behavior(m: ModelSpec) -> dict[str, Any]:
    a = m.autoscale
    return {"scaleUp": {"stabilizationWindowSeconds": int(a.up_window_s)},
            "scaleDown": {"stabilizationWindowSeconds": int(a.down_window_s)}}


def _meta(m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    return {"name": names.unit_name(opts, m), "namespace": opts.namespace, "labels": names.unit_labels(opts, m)}


def scaled_object(m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    trigger = {"type": "prometheus", "metricType": "AverageValue",
               "metadata": {"serverAddress": opts.prometheus_url, "query": queue_query(m, opts),
                            "threshold": f"{m.autoscale.waiting_per_copy:g}", "activationThreshold": "0"}}
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(m, opts),
            "spec": {"scaleTargetRef": _target(m, opts), "minReplicaCount": m.replicas.min,
                     "maxReplicaCount": m.replicas.max, "pollingInterval": 15,
                     "cooldownPeriod": int(m.autoscale.idle_s),  # to zero after this long idle (min: 0)
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(m)}},
                     "triggers": [trigger]}}


def hpa(m: ModelSpec, opts: KubernetesOptions) -> dict[str, Any]:
    metric = {"type": "Pods", "pods": {"metric": {"name": ADAPTER_METRIC},
                                       "target": {"type": "AverageValue",
                                                  "averageValue": f"{m.autoscale.waiting_per_copy:g}"}}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(m, opts),
            "spec": {"scaleTargetRef": _target(m, opts), "minReplicas": max(1, m.replicas.min),
                     "maxReplicas": m.replicas.max, "metrics": [metric], "behavior": _behavior(m)}}
