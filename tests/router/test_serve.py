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
from fleet_helpers import ADMIN, LOG_DIR, free_ports, listening, with_admin_token

from fleetllm.fleet.config import FleetConfig


def start_serve(*args: str, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    fd, name = tempfile.mkstemp(prefix="fleetllm-serve-", suffix=".log", dir=LOG_DIR)
    argv = with_admin_token(["serve", "--port", str(port), *args])
    p = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", *argv],
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
    cfg.write_text(f"log_dir: {tmp_path / 'logs'}\n"
                   "policy: round_robin\n"
                   "machines: [{name: a, cores: 1, zone: zone-a}, {name: b, cores: 1, zone: zone-b}]\n"
                   "models:\n"
                   "  - {source: smollm2-135m, simulate: true, replicas: 4, engine: {max_num_seqs: 8}}\n")
    p, log = start_serve("--config", str(cfg), port=port)
    try:
        state = httpx.get(f"http://127.0.0.1:{port}/router/state", headers=ADMIN).json()
        assert sorted(w["zone"] for w in state["workers"]) == ["zone-a", "zone-a", "zone-b", "zone-b"]
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


def test_a_fleet_always_has_its_own_worker_secret_and_admin_token_file(tmp_path):
    from fleetllm.fleet.launcher import Fleet
    from fleetllm.server.worker_secret import ENV

    (tmp_path / "keys.yaml").write_text("keys: []\n")
    cfg = FleetConfig.single_model("smollm2-135m", 2, simulate=True)
    cfg.log_dir, cfg.keys_file = str(tmp_path), str(tmp_path / "keys.yaml")
    fleet = Fleet(cfg)
    token = tmp_path / "admin-token"
    assert fleet.admin_token_file == token and token.stat().st_mode & 0o777 == 0o600
    assert token.read_text().strip() == fleet.admin_token and fleet.admin_token != fleet.secret
    rcmd = fleet.router.cmd
    assert rcmd[rcmd.index("--admin-token-file") + 1] == str(token)
    assert all(u.startswith("fleetllm+http://") for u in rcmd[rcmd.index("--workers") + 1].split(","))
    procs = [*fleet.workers, fleet.router]
    assert all(p.env[ENV] == fleet.secret and fleet.secret not in " ".join(p.cmd) for p in procs)
    assert (tmp_path / "keys.yaml").read_text() == "keys: []\n"  # never written into the keys file


def test_a_router_started_alone_mints_an_admin_token_and_prints_its_file(tmp_path, capsys):
    import shutil

    from fleetllm.cli import admin_token_file, build_parser

    args = build_parser("router").parse_args(["router"])
    minted = admin_token_file(args)
    path = Path(args.admin_token_file)
    assert minted == str(path.parent)  # the router removes it when it exits
    try:
        assert capsys.readouterr().out == f"admin token file: {path}\n"
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(path.parent)
    given = build_parser("router").parse_args(["router", "--admin-token-file", str(tmp_path / "t")])
    assert admin_token_file(given) is None  # a file given is the operator's: kept
    first = (tmp_path / "t").read_text()
    admin_token_file(given)
    assert (tmp_path / "t").read_text() == first  # an existing file is read, never rewritten


@pytest.mark.slow
def test_serve_with_state_url_auto_runs_a_private_redis_for_its_router_and_stops_it_with_the_fleet(tmp_path):
    import re
    import socket

    from fleetllm.router.keys import KeyStore

    keys = KeyStore(tmp_path / "keys.yaml")
    _, key = keys.create("team", rpm_limit=100)
    _, admin = keys.create("ops", admin=True)
    port = free_ports(2)
    p, log = start_serve("--simulate", "--replicas", "1", "--state-url", "auto", "--keys-file", str(keys.path),
                         "--log-dir", str(tmp_path / "logs"), port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30,
                       headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200
        metrics = httpx.get(url + "/metrics?federate=0", headers={"authorization": f"Bearer {admin}"}).text
        assert "fleetllm:router_state_degraded 0.0" in metrics
        store = int(re.search(r"router state shared through redis://127\.0\.0\.1:(\d+)",
                              (tmp_path / "logs" / "router.log").read_text()).group(1))
        socket.create_connection(("127.0.0.1", store), timeout=2).close()
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", store), timeout=2).close()
    log.unlink()
