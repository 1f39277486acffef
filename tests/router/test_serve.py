"""`fleetllm serve`: a fleet of worker processes and a router, started, used and stopped cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from fleet_helpers import free_ports, listening

from fleetllm.fleet.config import FleetConfig


def start_serve(*args: str, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    fd, name = tempfile.mkstemp(prefix="fleetllm-serve-", suffix=".log")
    p = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", "serve", "--port", str(port), *args],
                         stdout=fd, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(fd)
    log = Path(name)
    end = time.monotonic() + 240
    while "fleet ready" not in log.read_text(errors="replace"):
        if p.poll() is not None or time.monotonic() > end:
            p.kill()
            raise RuntimeError(f"serve did not become ready:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    return p, log


@pytest.mark.slow
def test_serve_from_a_yaml_config_with_zones_and_simulated_workers(tmp_path):
    port = free_ports(5)
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text("policy: round_robin\n"
                   "machines: [{name: a, cores: 1, zone: zone-a}, {name: b, cores: 1, zone: zone-b}]\n"
                   "models:\n"
                   "  - {source: smollm2-135m, simulate: true, replicas: 4, engine: {max_num_seqs: 8}}\n")
    p, log = start_serve("--config", str(cfg), port=port)
    try:
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert sorted(w["zone"] for w in health["workers"]) == ["zone-a", "zone-a", "zone-b", "zone-b"]
        for i in range(4):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": f"n{i}", "max_tokens": 4},
                           timeout=30)
            assert r.status_code == 200
        zones = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'fleetllm_router_zone_requests_total{zone="zone-a"}' in zones
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
    assert not any(listening(f"http://127.0.0.1:{port + i}") for i in range(5))
    log.unlink()


def test_fleet_config_rejects_unknown_keys(tmp_path):
    with pytest.raises(ValueError, match="replica"):
        FleetConfig.from_dict({"models": [{"replica": 2}]})
    with pytest.raises(ValueError, match="polcy"):
        FleetConfig.from_dict({"polcy": "x"})


def test_a_disaggregated_fleet_plan_gives_workers_their_roles_and_the_router_its_threshold(tmp_path):
    from fleetllm.fleet.launcher import Fleet

    cfg = FleetConfig.single_model("smollm2-135m", 0, prefill=1, decode=2)
    cfg.port, cfg.pd_threshold, cfg.log_dir = 9000, 1024, str(tmp_path)
    fleet = Fleet(cfg)
    roles = [p.cmd[p.cmd.index("--role") + 1] for p in fleet.workers]
    assert roles == ["prefill", "decode", "decode"]
    rcmd = fleet.router.cmd
    assert rcmd[rcmd.index("--roles") + 1] == "prefill,decode,decode"
    assert rcmd[rcmd.index("--pd-threshold") + 1] == "1024"
    assert fleet.worker_urls == [f"http://127.0.0.1:{9001 + i}" for i in range(3)]
