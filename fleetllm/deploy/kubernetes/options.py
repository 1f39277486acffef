"""What ``fleetllm deploy kubernetes`` needs beyond the fleet YAML: where and as what the fleet runs in a cluster.

Each field is a flag of ``fleetllm deploy kubernetes`` (generated, :mod:`fleetllm.cli_options`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from fleetllm.cli import WorkerOptions
from fleetllm.cli_options import opt

MAX_NAME = 40  # the fleet's name, and a unit's label value
# a unit's objects: a StatefulSet's pods carry a controller-revision-hash label (its name + "-" + 10
# characters) and KEDA names its HPA "keda-hpa-" + name, both within a label's 63 characters
MAX_OBJECT_NAME = 52


@dataclass
class KubernetesOptions:
    """The cluster side of a fleet: namespace, image, the fleet's name and which operators' objects to write."""

    name: str = opt("fleetllm", "the fleet's name: prefix of every object and its app.kubernetes.io/instance label")
    namespace: str = opt("default", "namespace of every object")
    image: str = opt("fleetllm:latest", "container image with fleetllm installed (the `fleetllm` command on PATH)")
    router_replicas: int = opt(1, "router pods (each keeps its own prefix index from the workers' KV events)")
    worker_secret: str | None = opt(None, "Secret (key `secret`) holding the router-worker shared secret "
                                          "(default: NAME-worker-secret)")
    autoscaler: Literal["keda", "hpa", "none"] = opt(
        "keda", "per autoscaled model: a KEDA ScaledObject on the Prometheus queue metric, or an HPA on the "
                "same metric through prometheus-adapter")
    prometheus_url: str = opt("http://prometheus-operated.monitoring.svc:9090", "the Prometheus KEDA asks")
    monitor: Literal["servicemonitor", "podmonitor", "none"] = opt("servicemonitor",
                                                                   "Prometheus operator scrape objects")
    accelerator_resource: str = opt("nvidia.com/gpu", "extended resource a model's `accelerators` request")
    cache_size: str = opt("50Gi", "per-pod volume for models pulled from hf:// or s3:// (a StatefulSet's claim)")
    drain_timeout_s: float = opt(WorkerOptions.drain_timeout_s, "seconds a worker drains on SIGTERM (its "
                                                                 "pod's grace period is 15 s longer)")
    ray: bool = opt(False, "KubeRay mode: a RayService (workers as Ray actors) and the fleet controller")
    run_as_user: int = opt(1000, "the non-root user (and group) every container runs as; the image must let it "
                                 "read fleetllm")
    monitoring_namespace: str = opt("monitoring", "namespace of the Prometheus that scrapes the workers (their "
                                                  "NetworkPolicy lets it in)")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", self.name) or len(self.name) > MAX_NAME:
            raise ValueError(f"fleet name {self.name!r}: lowercase letters, digits and '-', starting with a "
                             f"letter, at most {MAX_NAME} characters")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"namespace {self.namespace!r} is not a DNS label")
        if self.run_as_user <= 0:
            raise ValueError(f"run-as-user {self.run_as_user}: pods run as a non-root user (a uid above 0)")
        if self.worker_secret is None:
            self.worker_secret = f"{self.name}-worker-secret"

    @property
    def grace_period_s(self) -> int:
        """A pod's termination grace period: the drain, plus time for the engine to stop after it."""
        return int(self.drain_timeout_s) + 15
