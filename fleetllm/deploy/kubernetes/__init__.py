"""Kubernetes manifests for a fleet (``fleetllm deploy kubernetes``): the router, each unit's workers, the
fleet config, Prometheus operator monitors, KEDA or HPA scalers, or a KubeRay RayService (``--ray``).

One module per object family: ``workers`` (Deployment/StatefulSet, Service, PodDisruptionBudget), ``router``
(Deployment, Service, RBAC, ConfigMap), ``monitoring``, ``scaling``, ``ray``; ``names`` holds the labels
they share with the router's discovery; ``render`` assembles and writes them.
"""

from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.deploy.kubernetes.render import kubernetes_manifests, render, write

__all__ = ["KubernetesOptions", "kubernetes_manifests", "render", "write"]
