"""A check run by hand (not in the suite, for its time): autoscaling and SIGHUP on a Ray fleet.

On a two-node Ray cluster of this machine, `fleetllm serve` with model `a` (one copy) and model `z`
(`min: 0`): a request for `z` is held while the controller creates its actor, answered once the router
discovers it; idle, `z` scales back to zero (actor drained and killed, the router drops it); SIGHUP rolls a
restart through the copies (Ray restarts each actor, at a new address). Prints what it sees; exits 1 on a failure.

    PYTHONPATH=$PWD python scripts/ray_fleet_check.py
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from fleetllm.fleet.ray_local import LocalNode, LocalRayCluster, free_port

SIM = {"source": "smollm2-135m", "simulate": True, "engine": {"sim_speed": 20}}


def until(ok, what: str, timeout_s: float = 90.0) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"FAILED: {what}")
        time.sleep(0.5)
    return time.monotonic() - t0


def main() -> int:
    cluster = LocalRayCluster([LocalNode("127.0.0.2", 2, labels={"zone": "a"}),
                               LocalNode("127.0.0.3", 2, labels={"zone": "b"})]).start()
    tmp = Path(tempfile.mkdtemp(prefix="fleetllm-ray-check-"))
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    cfg = {"port": port, "log_dir": str(tmp / "logs"), "ray": {"address": cluster.address, "namespace": "check"},
           "router_args": ["--hold-timeout", "120"],
           "models": [{**SIM, "name": "a", "replicas": 1},
                      {**SIM, "name": "z", "replicas": {"min": 0, "max": 1, "initial": 0},
                       "autoscale": {"idle_s": 4, "cooldown_s": 1, "down_window_s": 2}}]}
    (tmp / "fleet.yaml").write_text(yaml.safe_dump(cfg))
    with open(tmp / "serve.log", "wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", "serve", "--config", str(tmp / "fleet.yaml")],
                                 env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        until(lambda: b"fleet ready" in (tmp / "serve.log").read_bytes(), "serve ready", 180)

        def workers(healthy_only: bool = False) -> list[dict]:
            token = (tmp / "logs" / "admin-token").read_text().strip()  # the fleet's admin token (in its log dir)
            ws = httpx.get(url + "/router/state", headers={"authorization": f"Bearer {token}"},
                           timeout=10).json()["workers"]
            return [w for w in ws if w["healthy"] or not healthy_only]

        def complete(model: str) -> httpx.Response:
            return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3},
                              timeout=150)

        t0 = time.monotonic()
        r = complete("z")
        print(f"held request for z: {r.status_code} after {time.monotonic() - t0:.1f}s "
              f"(router cold start {r.headers.get('x-fleetllm-cold-start-ms')} ms)")
        print(f"back to zero after {until(lambda: not any(w['model'] == 'z' for w in workers()), 'z to zero'):.1f}s")
        before = {w["url"] for w in workers()}
        serve.send_signal(signal.SIGHUP)
        moved = until(lambda: (now := {w["url"] for w in workers(True)}) and not now & before, "rolling restart")
        print(f"SIGHUP: every copy at a new address after {moved:.1f}s; a answers {complete('a').status_code}")
    finally:
        serve.send_signal(signal.SIGTERM)
        print(f"serve exited with {serve.wait(60)}")
        cluster.stop()
        print(f"cluster processes left: {len(cluster.processes())}")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
