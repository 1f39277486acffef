"""The manifests as a platform team's policy reads them: hardened pods, the API token only where it is
used, NetworkPolicies around router, workers and Ray, a cloud identity per model, the router's domain,
and secrets as files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetllm.deploy.kubernetes import kubernetes_manifests
from fleetllm.deploy.kubernetes.security import pod_templates
from fleetllm.fleet.config import FleetConfig
from fleetllm.server.worker_secret import ENV as WORKER_SECRET_ENV

DATA = Path(__file__).parent.parent / "data" / "kubernetes"
WORKLOADS = ("Deployment", "StatefulSet", "RayService")


@pytest.fixture(scope="module")
def fleet() -> FleetConfig:
    return FleetConfig.from_yaml(DATA / "fleet-2-models.yaml")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "ray"])
def docs(request, fleet: FleetConfig) -> list[dict[str, Any]]:
    return kubernetes_manifests(fleet, namespace="llm", ray=request.param)


def _named(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pods(docs: list[dict]) -> list[dict]:
    return [t for d in docs if d["kind"] in WORKLOADS for t in pod_templates(d)]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes' label selector semantics (matchLabels and In expressions)."""
    exprs = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in exprs)
    return selector.get("matchLabels", {}).items() <= labels.items() and \
        all(labels.get(e["key"]) in e["values"] for e in exprs)


def test_every_pod_and_container_runs_non_root_read_only_without_capabilities(docs: list[dict]):
    pods = _pods(docs)
    ray = any(d["kind"] == "RayService" for d in docs)
    assert len(pods) == (6 if ray else 5)  # router or controller, four units' workers or Ray groups, Ray's head
    for t in pods:
        pod = t["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert (sc["runAsNonRoot"], sc["readOnlyRootFilesystem"], sc["allowPrivilegeEscalation"]) == (True, True, False)
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert any(m["mountPath"] == "/tmp" and m["name"] in scratch for m in c["volumeMounts"])


def test_only_the_router_and_an_autoscaling_ray_head_mount_the_api_token(docs: list[dict]):
    mounted = {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in _pods(docs)
               if t["spec"]["automountServiceAccountToken"]}
    ray = any(d["kind"] == "RayService" for d in docs)
    assert mounted == ({"ray-head"} if ray else {"router"})  # discovery's watch; KubeRay's autoscaler
    assert all(sa["automountServiceAccountToken"] is False for sa in _named(docs, "ServiceAccount").values())


def test_a_ray_head_without_autoscaling_mounts_no_api_token():
    cfg = FleetConfig.from_dict({"models": [{"name": "m", "replicas": 2}]})
    [head] = [t for t in _pods(kubernetes_manifests(cfg, ray=True))
              if t["metadata"]["labels"]["app.kubernetes.io/component"] == "ray-head"]
    assert head["spec"]["automountServiceAccountToken"] is False


def test_network_policies_admit_only_the_fleets_own_traffic(docs: list[dict]):
    policies = list(_named(docs, "NetworkPolicy").values())
    pods = _pods(docs)
    # every pod of the fleet is selected by a policy (so it refuses whatever the policy does not allow)
    for t in pods:
        assert any(_selects(p["spec"]["podSelector"], t["metadata"]["labels"]) for p in policies), t["metadata"]
    router = _named(docs, "NetworkPolicy")["fleetllm-router"]["spec"]
    assert router["ingress"] == [{"ports": [{"protocol": "TCP", "port": "http"}]}]  # its API port, from anywhere
    if any(d["kind"] == "RayService" for d in docs):
        [rule] = _named(docs, "NetworkPolicy")["fleetllm-ray"]["spec"]["ingress"]
        assert rule == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fleetllm",
                                                                  "app.kubernetes.io/instance": "fleetllm"}}}]}
        return
    # a model's workers: from the router, the model's own workers (P/D peers) and Prometheus, on their port
    [rule] = _named(docs, "NetworkPolicy")["fleetllm-workers-chat"]["spec"]["ingress"]
    router_pods, peers, monitoring = rule["from"]
    assert router_pods["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert monitoring == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert rule["ports"] == [{"protocol": "TCP", "port": "http"}]
    units = {t["metadata"]["labels"].get("fleetllm.io/unit"): t["metadata"]["labels"] for t in pods}
    assert {u for u, labels in units.items() if u and _selects(peers["podSelector"], labels)} == {
        "chat-prefill", "chat-decode"}  # not the coder's workers


def test_each_unit_runs_as_its_own_service_account_with_its_models_identity(docs: list[dict]):
    accounts = _named(docs, "ServiceAccount")
    role = {n: sa["metadata"].get("annotations", {}).get("eks.amazonaws.com/role-arn") for n, sa in accounts.items()}
    assert role["fleetllm-coder-stable"] == "arn:aws:iam::123456789012:role/coder-weights"  # IRSA
    assert role["fleetllm-router"] == "arn:aws:iam::123456789012:role/fleet-router"
    assert role["fleetllm-chat-prefill"] is None and role["fleetllm-coder-canary"] is None  # Pod Identity; none
    for t in _pods(docs):
        unit = t["metadata"]["labels"].get("fleetllm.io/unit")
        name = t["spec"].get("serviceAccountName")
        if unit is not None:
            assert name == f"fleetllm-{unit}" and name in accounts
        elif t["metadata"]["labels"]["app.kubernetes.io/component"] == "router":
            assert name == "fleetllm-router"


def test_the_domain_gets_an_ingress_with_a_certificate_and_a_dns_record(docs: list[dict]):
    [ingress] = _named(docs, "Ingress").values()
    notes = ingress["metadata"]["annotations"]
    assert notes["cert-manager.io/cluster-issuer"] == "letsencrypt-prod"
    assert notes["external-dns.alpha.kubernetes.io/hostname"] == "llm.example.com"
    spec = ingress["spec"]
    assert spec["tls"] == [{"hosts": ["llm.example.com"], "secretName": "fleetllm-tls"}] and spec["ingressClassName"] == "nginx"
    backend = spec["rules"][0]["http"]["paths"][0]["backend"]["service"]
    service = _named(docs, "Service")[backend["name"]]
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"


def test_no_domain_no_ingress():
    assert not any(d["kind"] == "Ingress" for d in kubernetes_manifests(FleetConfig.from_dict({})))


def _mount_of(pod: dict, c: dict, path: str) -> dict:
    """The Secret volume ``path`` lies in, for container ``c`` (the innermost of nested mounts)."""
    m = max((m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")), key=lambda m: len(m["mountPath"]))
    return next(v for v in pod["volumes"] if v["name"] == m["name"])["secret"]


def test_secrets_reach_the_pods_as_files_and_ray_takes_only_its_token(docs: list[dict]):
    ray = any(d["kind"] == "RayService" for d in docs)
    for t in _pods(docs):
        pod = t["spec"]
        for c in pod["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            from_secrets = {n for n, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
            assert from_secrets <= {WORKER_SECRET_ENV}  # the hub token and Ray's token never
            if ray:
                assert env["RAY_AUTH_MODE"]["value"] == "token"
                assert _mount_of(pod, c, env["RAY_AUTH_TOKEN_PATH"]["value"])["secretName"] == "fleetllm-ray-token"
            elif "--token-file" in c["args"]:
                token = c["args"][c["args"].index("--token-file") + 1]
                assert _mount_of(pod, c, token)["items"] == [{"key": "HF_TOKEN", "path": "HF_TOKEN"}]
    if ray:
        [service] = _named(docs, "RayService").values()
        assert service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    else:
        args = _named(docs, "StatefulSet")["fleetllm-chat-decode"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--token-file" in args and "--token-env" not in args


@pytest.mark.parametrize("key, value, error", [
    ("identity", {"aws_role_arn": "my-role"}, "is not an IAM role ARN"),
    ("identity", {"role": "arn:aws:iam::123456789012:role/x"}, "unknown key `identity.role`"),
    ("domain", "not a host", "is not a DNS name"),
])
def test_a_bad_identity_or_domain_is_one_line_naming_it(tmp_path: Path, capsys, key: str, value: Any, error: str):
    import yaml

    from fleetllm.cli import main

    bad = tmp_path / "fleet.yaml"
    bad.write_text(yaml.safe_dump({key: value, "models": [{"name": "m"}]}))
    assert main(["deploy", "kubernetes", "--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert error in err and len(err.strip().splitlines()) == 1
