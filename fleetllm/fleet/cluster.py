"""What a fleet is in a cluster beyond its processes: each model's cloud identity, and the fleet's domain.

Both are read by ``fleetllm deploy kubernetes`` only (a laptop fleet ignores them):

- ``identity:`` (per model, or for the fleet: the router's) says which cloud role its pods act as, so a
  model reads its own weights bucket and nothing else. ``aws_role_arn`` alone is EKS IRSA (the
  ServiceAccount's ``eks.amazonaws.com/role-arn`` annotation); with ``pod_identity: true`` it is EKS Pod
  Identity (no annotation: an association of the ServiceAccount with the role, made with the AWS API).
- ``domain:`` is the router's public name: an Ingress with TLS from cert-manager and the external-dns
  annotation that makes the record (Route 53 on AWS). ``domain: llm.example.com`` or the mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fleetllm.errors import UsageError

_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+")
_HOST = re.compile(r"(?=.{1,253}$)(\*\.)?([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass
class Identity:
    """The cloud role a model's pods (or the router's) act as."""

    aws_role_arn: str | None = None  # arn:aws:iam::ACCOUNT:role/NAME
    pod_identity: bool = False  # EKS Pod Identity instead of IRSA: no annotation, an association instead

    def __post_init__(self) -> None:
        if self.aws_role_arn is None:
            raise UsageError("identity: aws_role_arn is required (arn:aws:iam::ACCOUNT:role/NAME)")
        if not _ROLE_ARN.fullmatch(self.aws_role_arn):
            raise UsageError(f"identity: {self.aws_role_arn!r} is not an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME)")

    @property
    def annotations(self) -> dict[str, str]:
        """The ServiceAccount's annotations (IRSA's role; Pod Identity needs none)."""
        return {} if self.pod_identity else {"eks.amazonaws.com/role-arn": str(self.aws_role_arn)}


@dataclass
class Domain:
    """The router's public host name, its certificate issuer and the Ingress class that serves it."""

    host: str = ""
    cluster_issuer: str = "letsencrypt"  # cert-manager ClusterIssuer that signs the certificate
    ingress_class: str | None = None  # e.g. alb, nginx (default: the cluster's default class)
    tls_secret: str | None = None  # where cert-manager keeps the certificate (default: FLEET-tls)

    def __post_init__(self) -> None:
        if not _HOST.fullmatch(self.host):
            raise UsageError(f"domain: {self.host!r} is not a DNS name (host: llm.example.com)")
