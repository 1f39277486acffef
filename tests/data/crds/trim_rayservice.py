"""Trim KubeRay's RayService CRD (1 MB) to what the manifest tests validate: ``python trim_rayservice.py IN OUT``.

Kept: the served ``v1`` schema of ``spec``. Dropped: other versions, ``status``, every ``description``.
Replaced by an open object: the pod templates (``template``) and the Services (``headService``,
``serveService``): they are Kubernetes types, which the tests validate against the Kubernetes schemas.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
KUBERNETES_TYPES = ("template", "headService", "serveService")


def trim(node: Any) -> Any:
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            node["properties"] = {k: dict(OPEN) if k in KUBERNETES_TYPES else trim(v) for k, v in props.items()}
        return {k: (v if k == "properties" else trim(v)) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [trim(v) for v in node]
    return node


def main(src: str, dst: str) -> None:
    crd = yaml.safe_load(open(src))
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = v1["schema"]["openAPIV3Schema"]
    schema["properties"].pop("status", None)
    v1["schema"]["openAPIV3Schema"] = trim(schema)
    v1.pop("subresources", None)
    v1.pop("additionalPrinterColumns", None)
    crd["spec"]["versions"] = [v1]
    with open(dst, "w") as f:
        f.write("# Trimmed by trim_rayservice.py from KubeRay's ray-operator/config/crd/bases/ray.io_rayservices.yaml"
                " (see README.md)\n")
        yaml.safe_dump(crd, f, sort_keys=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
