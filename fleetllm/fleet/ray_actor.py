"""One fleet copy as a Ray actor: the actor owns one ``fleetllm worker`` process on the node Ray chose.

The actor picks a free port on its node's address, starts the worker command there and says where it
listens (:meth:`WorkerActor.info`), which is what the router's Ray discovery reads. Fate is shared both ways,
so a copy is always one actor plus one worker process or nothing:

- the worker process gets SIGKILL when the actor's process dies (``PR_SET_PDEATHSIG``): a killed actor, or a
  lost node whose raylet took its workers with it, leaves no orphan worker behind;
- the actor exits when its worker exits unasked, so Ray starts the pair again (``max_restarts``) on a node
  with room, as it does for a killed actor or a lost node.

The worker's output goes to the actor's own log (Ray's worker logs of that node).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import ray

from fleetllm.fleet.config import ModelSpec, RaySettings
from fleetllm.fleet.lifetime import die_with_parent
from fleetllm.fleet.ray_local import free_port
from fleetllm.router.discovery.ray import ACTOR_PREFIX  # the names the router's discovery looks for

__all__ = ["ACTOR_PREFIX", "WorkerActor", "actor_options"]


def actor_options(m: ModelSpec, ray_cfg: RaySettings, name: str, index: int, restart: bool) -> dict[str, Any]:
    """Ray actor options for copy ``index`` of ``m``: its resource requests, placement and restart policy.

    A model that lists ``zones`` has its copies spread over them in turn, each pinned by a node label."""
    r = m.resources
    opts: dict[str, Any] = {
        "name": name, "namespace": ray_cfg.namespace,
        # a simulated copy needs no core of its own; a real one at least one unless told
        "num_cpus": r.cores if r.cores is not None else (0 if m.simulate else 1),
        "num_gpus": r.accelerators, "memory": int((r.memory_gb or 0) * 2**30), "resources": dict(r.custom),
        "scheduling_strategy": ray_cfg.strategy,
        "max_restarts": -1 if restart else 0,
        "max_concurrency": 4,  # info() answers while stop() waits for a drain
    }
    if m.zones:
        opts["label_selector"] = {ray_cfg.zone_label: m.zones[index % len(m.zones)]}
    return opts


class WorkerActor:
    """Starts ``fleetllm <args> --host <node> --port <free> --zone <node's zone>`` and watches it."""

    def __init__(self, args: list[str], labels: dict[str, str], env: dict[str, str], hide: list[str],
                 zone_label: str = "zone") -> None:
        self.host = ray.util.get_node_ip_address()
        self.port = free_port(self.host)
        self.zone = ray.get_runtime_context().get_node_labels().get(zone_label, "")
        self.labels = labels  # model, variant, role: what the router files the copy under
        cmd = [sys.executable, "-m", "fleetllm.cli", *args, "--host", self.host, "--port", str(self.port),
               "--zone", self.zone]
        full_env = {**{k: v for k, v in os.environ.items() if k not in hide}, **env, "PYTHONUNBUFFERED": "1"}
        self.stopping = False
        self.popen: subprocess.Popen[bytes] | None = None
        started = threading.Event()
        # the thread that forks the worker must outlive it: PR_SET_PDEATHSIG fires when that thread ends
        threading.Thread(target=self._run, args=(cmd, full_env, started), daemon=True).start()
        started.wait()

    def _run(self, cmd: list[str], env: dict[str, str], started: threading.Event) -> None:
        try:
            self.popen = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        finally:
            started.set()
        code = self.popen.wait()
        if not self.stopping:
            print(f"fleetllm worker exited with {code}; the actor exits so that Ray starts both again", flush=True)
            os._exit(1)

    def info(self) -> dict[str, str]:
        """Where the copy listens and what it serves (the router's discovery reads this)."""
        return {"url": f"http://{self.host}:{self.port}", "zone": self.zone,
                "node": ray.get_runtime_context().get_node_id(), **self.labels}

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the worker (it drains), SIGKILL it after ``grace_s``; the actor stays until killed."""
        self.stopping = True
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        self.popen.terminate()
        try:
            return self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()

