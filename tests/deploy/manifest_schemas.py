"""Validation of generated manifests: built-in kinds with kubernetes-validate (strict: an unknown field is an
error), custom resources against the vendored CRDs of tests/data/crds (made strict the same way)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

CRDS = Path(__file__).parent.parent / "data" / "crds"
# kubernetes-validate reads and parses its schema files (the definitions: megabytes) on every call: once will do
kubernetes_validate.utils.schema_contents = cache(kubernetes_validate.utils.schema_contents)
KUBERNETES_VERSIONS = ("1.30", "1.37")  # the oldest the manifests are written for, and the newest schemas


def strict(node: Any) -> Any:
    """A CRD's OpenAPI v3 schema as JSON Schema that refuses unknown fields (the API server would prune them)."""
    if isinstance(node, list):
        return [strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if node.get("nullable") and isinstance(node.get("type"), str):
        out["type"] = [node["type"], "null"]
    return out


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """``(apiVersion, kind)`` -> schema, for every served version of every vendored CRD."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)  # C: the pure-Python loader takes seconds
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            if v.get("served", True):
                schemas[(f"{group}/{v['name']}", kind)] = strict(v["schema"]["openAPIV3Schema"])
    return schemas


def validate(doc: dict[str, Any]) -> None:
    """Raise if ``doc`` is not a valid object of its kind (a custom resource's pod templates included)."""
    schema = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        return
    jsonschema.Draft7Validator(schema).validate(doc)
    for template in pod_templates(doc):
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates a RayService embeds (its CRD leaves them to the Kubernetes schema)."""
    if doc["kind"] != "RayService":
        return []
    cluster = doc["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster.get("workerGroupSpecs", []))]
