"""The router finds its workers in Kubernetes EndpointSlices: the official client against recorded answers.

``tests/data/kubernetes/`` holds an EndpointSlice list and a sequence of watch events in the API
server's format (two Services of one model, ``coder``'s stable and canary variants); ``kube_api`` serves
them on 127.0.0.1 the way the API server does (list, then a chunked watch stream). The recorded pods'
port (8001) is pointed at two in-process workers of the test (answering the router's probes), so the
router health-checks what it discovers for real: pods appear (added, then routable), stop being ready
(drained: not routable), disappear (removed).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import ThreadServer, ThreadServers, free_port
from kube_api import FakeKubeAPI, gone_event
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleetllm.router.discovery import DiscoveredWorker
from fleetllm.router.discovery.kubernetes import endpoints

DATA = Path(__file__).parent.parent / "data" / "kubernetes"
SELECTOR = "app.kubernetes.io/instance=fleetllm,app.kubernetes.io/component=worker"


def recorded() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    events = [json.loads(line) for line in (DATA / "endpointslices-watch.jsonl").read_text().splitlines()]
    return json.loads((DATA / "endpointslices-list.json").read_text()), events


def wait_for(ok: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not ok():
        if time.monotonic() > end:
            pytest.fail(f"never: {what}")
        time.sleep(0.02)


def probed_worker() -> Starlette:
    """A worker as far as the router's checks go: ready and alive (a KV-event stream it has not)."""
    ok = lambda request: JSONResponse({"status": "ready"})  # noqa: E731
    return Starlette(routes=[Route("/ready", ok), Route("/health", ok)])


class Cluster:
    """The fake API server, two workers behind the recorded pods, a router discovering them."""

    def __init__(self, tmp: Path) -> None:
        self.workers_up = ThreadServers([probed_worker(), probed_worker()])
        self.workers_up.start()
        answer, self.events = recorded()
        self.listed = answer["items"]
        self.ports = {"fleetllm-coder-stable": int(self.workers_up.urls[0].rsplit(":", 1)[1]),
                      "fleetllm-coder-canary": int(self.workers_up.urls[1].rsplit(":", 1)[1])}
        for s in [*answer["items"], *(e["object"] for e in self.events)]:
            s["ports"][0]["port"] = self.ports[s["metadata"]["labels"]["kubernetes.io/service-name"]]
        self.api = FakeKubeAPI(answer["items"], answer["metadata"]["resourceVersion"]).start()
        from fleetllm.cli import build_parser, build_router

        port = free_port()
        args = build_parser().parse_args([
            "router", "--discover", "kubernetes", "--kubeconfig", str(self.api.kubeconfig(tmp / "kubeconfig")),
            "--k8s-namespace", "llm", "--k8s-selector", SELECTOR, "--policy", "least_load",
            "--traffic", "coder=stable:95,canary:5", "--health-interval", "0.2", "--host", "127.0.0.1",
            "--port", str(port)])
        self.router = build_router(args)
        self.server = ThreadServer(self.router.app, port, on_exit=lambda: setattr(self.router, "closing", True))
        self.server.start()

    def url(self, service: str, address: str = "127.0.0.1") -> str:
        return f"http://{address}:{self.ports[service]}"

    def workers(self) -> dict[str, Any]:
        return {w.url: w for w in self.router.workers}

    def stop(self) -> None:
        self.server.stop()
        self.api.stop()
        self.workers_up.stop()
        # the router's shutdown ends the discovery's watch thread
        assert not [t for t in threading.enumerate() if t.name == "k8s-endpointslices"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("kube"))
    yield c
    c.stop()


def test_pods_appearing_not_ready_and_gone_are_added_drained_and_removed(cluster: Cluster) -> None:
    stable, canary = cluster.url("fleetllm-coder-stable"), cluster.url("fleetllm-coder-canary")
    starting = cluster.url("fleetllm-coder-canary", "127.0.0.2")
    # the list: stable's one ready pod, routed to once its health check passes
    wait_for(lambda: set(cluster.workers()) == {stable}, "the listed pod is a worker")
    w = cluster.workers()[stable]
    assert (w.model, w.variant, w.zone, w.role) == ("coder", "stable", "eu-west-1a", "both")
    wait_for(lambda: cluster.workers()[stable].routable(time.monotonic()), "the listed worker passes its checks")
    # the canary's Service appears with one ready pod and one still starting: only the ready one is added
    cluster.api.send(cluster.events[0])
    wait_for(lambda: set(cluster.workers()) == {stable, canary}, "the ready canary pod is added")
    cluster.api.send(cluster.events[1])
    wait_for(lambda: set(cluster.workers()) == {stable, canary, starting}, "the pod that became ready is added")
    # stable's pod is terminating (not ready): drained, the canary takes every request
    cluster.api.send(cluster.events[2])
    wait_for(lambda: cluster.workers()[stable].draining, "the not-ready pod is draining")
    assert not cluster.workers()[stable].routable(time.monotonic())
    wait_for(lambda: cluster.workers()[canary].routable(time.monotonic()), "the canary worker passes its checks")
    # stable's pod is gone, then the canary's Service is deleted: their workers are removed
    cluster.api.send(cluster.events[3])
    wait_for(lambda: set(cluster.workers()) == {canary, starting}, "the gone pod is removed")
    cluster.api.send(cluster.events[4])
    wait_for(lambda: not cluster.workers(), "a deleted Service's workers are removed")
    path, query = cluster.api.requests[1]
    assert query["watch"] == ["True"] and query["resourceVersion"] == ["48213"]  # from the list's version
    assert cluster.api.requests[0][1]["labelSelector"] == [SELECTOR]


def test_a_resync_a_failed_list_and_410_gone_each_lead_to_a_fresh_list(cluster: Cluster) -> None:
    stable = cluster.url("fleetllm-coder-stable")
    # the watch ends (the server's timeout: the periodic resync); the next list finds the recorded pod
    cluster.api.slices = {s["metadata"]["name"]: s for s in cluster.listed}
    cluster.api.end_watch()
    wait_for(lambda: set(cluster.workers()) == {stable}, "the resync's list adds the pod")
    lists_before = len([q for _, q in cluster.api.requests if "watch" not in q])
    # while the client is disconnected, the pod goes away (no event will say so) and the API fails once
    cluster.api.slices = {}
    cluster.api.fail_lists = 1
    cluster.api.end_watch()
    wait_for(lambda: not cluster.workers(), "the next successful list removes the gone pod")
    lists = [q for _, q in cluster.api.requests if "watch" not in q]
    assert len(lists) == lists_before + 2  # the failed one, the one after the backoff
    # a watch from a version the server no longer has (410 Gone): listed again at once
    restored = copy.deepcopy(cluster.events[2]["object"])
    restored["endpoints"][0]["conditions"] = {"ready": True, "serving": True, "terminating": False}
    cluster.api.slices = {restored["metadata"]["name"]: restored}
    cluster.api.send(gone_event())
    wait_for(lambda: set(cluster.workers()) == {stable}, "the list after 410 Gone adds the pod again")
    assert not cluster.workers()[stable].draining


def test_endpoints_reads_ports_by_name_ipv6_and_unknown_readiness() -> None:
    slices = [{"metadata": {"labels": {"fleetllm.io/role": "decode"}}, "addressType": "IPv6",
               "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8001}],
               "endpoints": [{"addresses": ["fd00::7"], "zone": "z1"},  # no conditions: unknown, taken as ready
                             {"addresses": ["fd00::8"], "conditions": {"ready": False}}]},
              {"metadata": {}, "addressType": "FQDN", "ports": [{"name": "http", "port": 8001}],
               "endpoints": [{"addresses": ["w.example"]}]}]
    assert endpoints(slices, "http") == {
        "http://[fd00::7]:8001": (DiscoveredWorker("http://[fd00::7]:8001", zone="z1", role="decode"), True),
        "http://[fd00::8]:8001": (DiscoveredWorker("http://[fd00::8]:8001", role="decode"), False)}


def test_a_router_without_api_access_refuses_to_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleetllm.cli import main

    assert main(["router", "--discover", "kubernetes", "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "fleetllm router: error: no Kubernetes API access" in capsys.readouterr().err
