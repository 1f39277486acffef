"""``fleetllm deploy kubernetes``: the manifests of a 2-model fleet, validated against the Kubernetes schemas
and the Prometheus operator, KEDA and KubeRay CRDs, and what they say about the fleet."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from manifest_schemas import validate

from fleetllm.deploy.kubernetes import KubernetesOptions, kubernetes_manifests, render
from fleetllm.fleet.config import FleetConfig

DATA = Path(__file__).parent.parent / "data" / "kubernetes"


@pytest.fixture(scope="module")
def fleet() -> FleetConfig:
    return FleetConfig.from_yaml(DATA / "fleet-2-models.yaml")


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_object_of_a_two_model_fleet_is_valid(fleet: FleetConfig) -> None:
    docs = kubernetes_manifests(fleet, namespace="llm", image="registry.example/fleetllm:1.0")
    assert sorted({d["kind"] for d in docs}) == [
        "ConfigMap", "Deployment", "Ingress", "NetworkPolicy", "PodDisruptionBudget", "Role", "RoleBinding",
        "ScaledObject", "Service", "ServiceAccount", "ServiceMonitor", "StatefulSet"]
    alternatives = kubernetes_manifests(fleet, namespace="llm", monitor="podmonitor", autoscaler="hpa")
    docs += [d for d in alternatives if d["kind"] in ("PodMonitor", "HorizontalPodAutoscaler")]
    docs += kubernetes_manifests(fleet, namespace="llm", ray=True)
    assert {"PodMonitor", "HorizontalPodAutoscaler", "RayService"} <= {d["kind"] for d in docs}
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("kind, path, typo", [
    ("StatefulSet", ("spec", "template", "spec", "containers", 0), "livenesProbe"),
    ("ServiceMonitor", ("spec", "endpoints", 0), "bearerTokenSecrett"),
    ("ScaledObject", ("spec",), "minReplicas"),
])
def test_a_misspelt_field_fails_validation(fleet: FleetConfig, kind: str, path: tuple, typo: str) -> None:
    doc = next(d for d in kubernetes_manifests(fleet) if d["kind"] == kind)
    node = doc
    for key in path:
        node = node[key]
    node[typo] = 1
    with pytest.raises(jsonschema.ValidationError, match=typo):
        validate(doc)


def test_each_unit_runs_with_its_own_resources_probes_grace_period_and_budget(fleet: FleetConfig) -> None:
    docs = kubernetes_manifests(fleet, drain_timeout_s=40)
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    # local sources run as Deployments; hub models keep their cache per pod in a StatefulSet
    assert {n: w["kind"] for n, w in workloads.items() if n != "fleetllm-router"} == {
        "fleetllm-coder-stable": "Deployment", "fleetllm-coder-canary": "Deployment",
        "fleetllm-chat-prefill": "StatefulSet", "fleetllm-chat-decode": "StatefulSet"}
    stable = workloads["fleetllm-coder-stable"]["spec"]
    pod = stable["template"]["spec"]
    worker = pod["containers"][0]
    assert worker["resources"] == {"requests": {"cpu": "2", "memory": "4096Mi"}, "limits": {"memory": "4096Mi", "cpu": "2"}}
    assert workloads["fleetllm-chat-decode"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == 1
    assert (worker["livenessProbe"]["httpGet"]["path"], worker["readinessProbe"]["httpGet"]["path"]) == ("/health", "/ready")
    assert pod["terminationGracePeriodSeconds"] > 40 and worker["args"][worker["args"].index("--drain-timeout") + 1] == "40"
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"] == ["eu-west-1a", "eu-west-1b"]
    assert stable["replicas"] == 2
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert set(pdbs) == set(workloads) - {"fleetllm-router"}
    assert pdbs["fleetllm-coder-stable"]["spec"]["selector"]["matchLabels"] == stable["selector"]["matchLabels"]


def test_autoscaled_units_scale_on_the_queue_metric_per_copy(fleet: FleetConfig) -> None:
    scaled = by_kind(kubernetes_manifests(fleet, namespace="llm"), "ScaledObject")
    assert set(scaled) == {"fleetllm-coder-stable", "fleetllm-chat-prefill", "fleetllm-chat-decode"}  # not the 1-copy canary
    stable = scaled["fleetllm-coder-stable"]["spec"]
    trigger = stable["triggers"][0]["metadata"]
    assert trigger["query"] == 'sum(vllm:num_requests_waiting{namespace="llm",fleetllm_io_unit="coder-stable"})'
    assert (trigger["threshold"], stable["minReplicaCount"], stable["maxReplicaCount"]) == ("3", 1, 4)
    assert stable["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 120}
    # scaled from zero: the requests the router holds for the model wake it
    assert "fleetllm_router_held_requests" in scaled["fleetllm-chat-prefill"]["spec"]["triggers"][0]["metadata"]["query"]
    assert scaled["fleetllm-chat-prefill"]["spec"]["minReplicaCount"] == 0
    hpas = by_kind(kubernetes_manifests(fleet, autoscaler="hpa"), "HorizontalPodAutoscaler")
    assert hpas["fleetllm-chat-prefill"]["spec"]["minReplicas"] == 1  # an HPA cannot scale to zero


def test_the_router_discovers_exactly_the_worker_services_the_endpointslices_are_copied_from(fleet: FleetConfig) -> None:
    docs = kubernetes_manifests(fleet, namespace="llm")
    args = by_kind(docs, "Deployment")["fleetllm-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    selector = dict(kv.split("=") for kv in args[args.index("--k8s-selector") + 1].split(","))
    services = by_kind(docs, "Service")
    workers = {n for n, s in services.items() if selector.items() <= s["metadata"]["labels"].items()}
    assert workers == {"fleetllm-coder-stable", "fleetllm-coder-canary", "fleetllm-chat-prefill", "fleetllm-chat-decode"}
    assert args[args.index("--k8s-namespace") + 1] == "llm" and "--traffic" in args and "--keys-file" in args
    # the recorded EndpointSlices of the discovery tests carry what the generator puts on the Services
    recorded = json.loads((DATA / "endpointslices-list.json").read_text())["items"][0]["metadata"]["labels"]
    assert services["fleetllm-coder-stable"]["metadata"]["labels"].items() <= recorded.items()
    role = by_kind(docs, "Role")["fleetllm-router"]["rules"]
    assert role == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]


def test_the_recorded_endpointslices_are_valid_endpointslices() -> None:
    answer = json.loads((DATA / "endpointslices-list.json").read_text())
    events = [json.loads(line) for line in (DATA / "endpointslices-watch.jsonl").read_text().splitlines()]
    for s in [*answer["items"], *(e["object"] for e in events)]:
        validate(s)


def test_the_config_map_holds_the_fleet_as_the_cluster_runs_it(fleet: FleetConfig) -> None:
    cm = by_kind(kubernetes_manifests(fleet), "ConfigMap")["fleetllm-fleet"]
    back = FleetConfig.from_dict(yaml.safe_load(cm["data"]["fleet.yaml"]))
    assert back.models == fleet.models and back.keys_file == "/etc/fleetllm/keys/keys.yaml"


def test_deploy_kubernetes_writes_the_manifests_and_the_secrets_to_create(tmp_path: Path, capsys) -> None:
    from fleetllm.cli import main

    assert main(["deploy", "kubernetes", "--config", str(DATA / "fleet-2-models.yaml"), "--out", str(tmp_path),
                 "--namespace", "llm", "--ray"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00-config.yaml", "05-service-accounts.yaml", "10-ray.yaml", "15-ingress.yaml", "30-monitoring.yaml",
        "50-network-policies.yaml", "README.md"]
    ray = list(yaml.safe_load_all((tmp_path / "10-ray.yaml").read_text()))
    controller = ray[1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert controller[:4] == ["serve", "--config", "/etc/fleetllm/fleet.yaml", "--ray"]
    readme = (tmp_path / "README.md").read_text()
    assert "fleetllm-worker-secret" in readme and "fleetllm-api-keys" in readme and "fleetllm-model-tokens" in readme
    assert "fleetllm-ray-token" in readme
    assert ("--service-account fleetllm-chat-prefill --role-arn arn:aws:iam::123456789012:role/chat-weights"
            in readme)  # the Pod Identity association to make


def test_names_that_are_no_dns_labels_get_a_hash_and_bad_variants_are_refused() -> None:
    cfg = FleetConfig.from_dict({"models": [{"name": "Org/Big_Model", "source": "hf://org/m@v1"}]})
    (name,) = [n for n in render(cfg, KubernetesOptions()) if n.startswith("20-worker-")]
    assert name.startswith("20-worker-org-big-model-") and len(name) == len("20-worker-org-big-model-") + 6 + 5
    cfg = FleetConfig.from_dict({"models": [{"name": "m", "variant": "v 2"}, {"name": "m", "variant": "v1"}]})
    with pytest.raises(ValueError, match="label value"):
        render(cfg, KubernetesOptions())


def test_deploy_refuses_a_fleet_the_cluster_cannot_take_by_name(tmp_path: Path, capsys) -> None:
    from fleetllm.cli import main

    bad = tmp_path / "fleet.yaml"
    bad.write_text("models: [{name: m, variant: 'v 2'}, {name: m, variant: v1}]\n")
    assert main(["deploy", "kubernetes", "--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "variant 'v 2' must be a Kubernetes label value" in capsys.readouterr().err


def test_every_container_command_line_is_one_fleetllm_accepts(fleet: FleetConfig) -> None:
    from fleetllm.cli import build_parser

    parser = build_parser()
    docs = kubernetes_manifests(fleet)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for pod in pods:
        container = pod["containers"][0]
        assert container["command"] == ["fleetllm"]
        args = parser.parse_args(container["args"])
        assert args.port == next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert len(pods) == 5


def test_the_router_pods_share_the_fleets_state_url_and_refuse_auto_or_a_password(fleet: FleetConfig) -> None:
    import dataclasses

    from fleetllm.errors import UsageError

    shared = dataclasses.replace(fleet, state_url="redis://redis.llm.svc:6379/0")
    docs = kubernetes_manifests(shared, namespace="llm")
    args = by_kind(docs, "Deployment")["fleetllm-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--state-url") + 1] == "redis://redis.llm.svc:6379/0"
    for url, words in (("auto", "a Redis the cluster runs"), ("redis://:hunter2@redis:6379", "written into the router")):
        with pytest.raises(UsageError, match=words) as refused:
            kubernetes_manifests(dataclasses.replace(fleet, state_url=url))
        assert "hunter2" not in str(refused.value)  # the message redacts it


def test_a_worker_asking_kv_remote_auto_is_refused_in_kubernetes(fleet: FleetConfig) -> None:
    import dataclasses

    from fleetllm.errors import UsageError

    m = dataclasses.replace(fleet.models[0], engine={**fleet.models[0].engine, "kv_remote": "auto"})
    with pytest.raises(UsageError, match="a Redis the cluster runs"):
        kubernetes_manifests(dataclasses.replace(fleet, models=[m, *fleet.models[1:]]))
