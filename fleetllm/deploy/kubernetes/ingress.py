"""The router's public name (the fleet's ``domain:``): an Ingress with TLS, a certificate and a DNS record.

cert-manager (``cert-manager.io/cluster-issuer``) signs a certificate for the host into the TLS Secret;
external-dns (``external-dns.alpha.kubernetes.io/hostname``) makes the host's record point at the Ingress's
load balancer (a Route 53 record on AWS, with external-dns's AWS provider). Answers stream as SSE: behind
ingress-nginx, response buffering is turned off and the read timeout outlasts a long generation.
"""

from __future__ import annotations

from typing import Any

from fleetllm.deploy.kubernetes import names
from fleetllm.deploy.kubernetes.options import KubernetesOptions
from fleetllm.fleet.config import FleetConfig

NGINX_STREAMING = {"nginx.ingress.kubernetes.io/proxy-buffering": "off",
                   "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"}


def ingress_objects(cfg: FleetConfig, opts: KubernetesOptions, service: str) -> list[dict[str, Any]]:
    """The Ingress of the router's Service ``service`` (none without ``domain:``)."""
    d = cfg.domain
    if d is None:
        return []
    annotations = {"cert-manager.io/cluster-issuer": d.cluster_issuer, "external-dns.alpha.kubernetes.io/hostname": d.host}
    if d.ingress_class == "nginx":
        annotations.update(NGINX_STREAMING)
    backend = {"service": {"name": service, "port": {"name": names.HTTP}}}
    spec: dict[str, Any] = {"tls": [{"hosts": [d.host], "secretName": d.tls_secret or f"{opts.name}-tls"}],
                            "rules": [{"host": d.host, "http": {"paths": [{"path": "/", "pathType": "Prefix",
                                                                           "backend": backend}]}}]}
    if d.ingress_class:
        spec["ingressClassName"] = d.ingress_class
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
             "metadata": {"name": service, "namespace": opts.namespace, "labels": names.fleet_labels(opts, "router"),
                          "annotations": annotations},
             "spec": spec}]
