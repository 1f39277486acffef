"""`fleetllm serve --ray` on a real two-node Ray cluster of this machine.

The head runs on 127.0.0.2 (zone a, 4 CPUs), a second node on 127.0.0.3 (zone b, 2 CPUs, an instance-type
resource); each copy asks for one CPU, so the four copies fill both nodes and the head alone has room for
two more. The router finds the copies through Ray; losing the second node (SIGKILL of its raylet) must cost
no request, and its copies come back on the head.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from fleet_helpers import free_ports, stop_process, wait_state, with_admin_token

from fleetllm.fleet.ray_local import LocalNode, LocalRayCluster

pytestmark = pytest.mark.slow
CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    """Two Ray nodes on this machine, each in its own session: stopping them ends their processes only."""
    cluster = LocalRayCluster([
        LocalNode("127.0.0.2", num_cpus=4, labels={"zone": "a"}),
        LocalNode("127.0.0.3", num_cpus=2, resources={"instance:small": 2}, labels={"zone": "b"}),
    ]).start()
    yield cluster
    cluster.stop()
    assert not cluster.processes(), "a process of the Ray cluster outlived it"


@pytest.fixture(scope="module")
def ray_fleet(ray_cluster: LocalRayCluster) -> Iterator[str]:
    """``fleetllm serve`` of 4 simulated copies (1 CPU each) as actors; yields the router's URL."""
    port = free_ports(1)
    tmp = Path(tempfile.mkdtemp(prefix="fleetllm-ray-"))
    cfg = {"port": port, "log_dir": str(tmp / "logs"),
           "ray": {"address": ray_cluster.address, "namespace": f"test-{os.getpid()}"},
           "models": [{"source": "smollm2-135m", "simulate": True, "replicas": 4, "resources": {"cores": 1},
                       "engine": {"sim_speed": 20}}]}
    (tmp / "fleet.yaml").write_text(yaml.safe_dump(cfg))
    log = open(tmp / "serve.log", "wb")
    argv = with_admin_token(["serve", "--config", str(tmp / "fleet.yaml")])
    popen = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", *argv],
                             stdout=log, stderr=subprocess.STDOUT, env={**ray_cluster.env, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_state_or_exit(popen, tmp / "serve.log", url)
        yield url
    finally:
        stop_process(popen, timeout=40)
        log.close()
        out = (tmp / "serve.log").read_text()[-3000:]
        shutil.rmtree(tmp, ignore_errors=True)
        assert popen.returncode == 0, out


def wait_state_or_exit(popen: subprocess.Popen, log: Path, url: str, timeout_s: float = 150.0) -> None:
    """Until ``fleetllm serve`` says the fleet is ready (it fails the test if serve exits first)."""
    end = time.monotonic() + timeout_s
    while b"fleet ready" not in log.read_bytes():
        if popen.poll() is not None or time.monotonic() > end:
            pytest.fail(f"fleetllm serve --ray did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def healthy(state: dict) -> list[dict]:
    return [w for w in state["workers"] if w["healthy"]]


def test_serve_ray_spreads_the_copies_over_both_nodes_and_routes_to_them(ray_fleet: str) -> None:
    state = wait_state(ray_fleet, lambda s: len(healthy(s)) == 4)
    hosts = sorted(httpx.URL(w["url"]).host for w in state["workers"])
    assert hosts == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
    assert {w["zone"] for w in state["workers"]} == {"a", "b"}  # each copy reports its node's zone label
    r = httpx.post(ray_fleet + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_a_lost_node_costs_no_request_and_its_copies_come_back_on_the_survivor(
        ray_cluster: LocalRayCluster, ray_fleet: str) -> None:
    wait_state(ray_fleet, lambda s: len(healthy(s)) == 4)
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:  # two clients sending non-streaming requests the whole time
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                try:
                    statuses.append(c.post(ray_fleet + "/v1/chat/completions", json=CHAT).status_code)
                except httpx.HTTPError:
                    statuses.append(0)  # no answer at all: lost

    clients = [threading.Thread(target=load) for _ in range(2)]
    for t in clients:
        t.start()
    try:
        os.kill(ray_cluster.raylet_pid(1), signal.SIGKILL)
        t0 = time.monotonic()
        # the router stops routing to the lost node's copies (its health checks), then Ray starts them again
        wait_state(ray_fleet, lambda s: not any("127.0.0.3" in w["url"] for w in healthy(s)), deadline_s=30)
        t_unrouted = time.monotonic() - t0
        state = wait_state(ray_fleet, lambda s: len(healthy(s)) == 4 and len(s["workers"]) == 4, deadline_s=90)
        print(f"lost node: unrouted after {t_unrouted:.1f}s, 4 copies back after {time.monotonic() - t0:.1f}s")
        sent_before = len(statuses)
        wait_state(ray_fleet, lambda s: len(statuses) > sent_before + 4)  # the replacements answer too
    finally:
        stop.set()
        for t in clients:
            t.join()
    assert {httpx.URL(w["url"]).host for w in state["workers"]} == {"127.0.0.2"}
    assert statuses and set(statuses) == {200}, f"{len(statuses)} requests: {statuses.count(200)} answered"
