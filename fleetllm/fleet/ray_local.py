"""A multi-node Ray cluster on one machine, for tests, benchmarks and trying ``fleetllm serve --ray``.

Each node is one ``ray start`` on its own loopback address (the head on 127.0.0.2, the others on .3, .4, ...:
Ray rewrites 127.0.0.1 to the machine's outward address, so that one is never used) with its own short temp
dir (Ray's socket paths must stay under 107 bytes), its own CPUs, custom resources and labels (a zone).

Every node is started in a session of its own, and every process Ray starts for it (GCS, raylet, agents,
actor workers, and the workers those actors start) stays in that session: :meth:`LocalRayCluster.stop` ends
exactly those processes and nothing else on the machine (``ray stop`` would end every Ray process there is).
Node death is detected in about 2 s instead of Ray's default 15 (``health_check_*``), so that a lost node's
actors come back elsewhere quickly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FAST_FAILURE_DETECTION = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                          "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "4"}


@dataclass
class LocalNode:
    """One node of the cluster: its loopback address and what it offers."""

    ip: str
    num_cpus: int = 2
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {"instance:small": 4}
    labels: dict[str, str] = field(default_factory=dict)  # e.g. {"zone": "b"}
    session: int | None = None  # the session id of every process of this node, once started


class LocalRayCluster:
    """``nodes[0]`` is the head. ``start()`` returns once every node is up; ``stop()`` ends all of them."""

    def __init__(self, nodes: list[LocalNode], root: str | None = None, object_store_mb: int = 80) -> None:
        self.nodes = nodes
        # short on purpose: Ray's socket paths live under it
        self.root = Path(root or tempfile.mkdtemp(prefix="fr", dir="/tmp"))
        self.object_store_mb = object_store_mb
        self.port = free_port(nodes[0].ip)
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", **FAST_FAILURE_DETECTION}

    @property
    def address(self) -> str:
        return f"{self.nodes[0].ip}:{self.port}"

    def _command(self, i: int, node: LocalNode) -> list[str]:
        ray = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start"]
        cmd = [*ray, "--node-ip-address", node.ip, "--temp-dir", str(self.root / f"n{i}"),
               "--num-cpus", str(node.num_cpus), "--resources", json.dumps(node.resources),
               "--labels", json.dumps(node.labels), "--object-store-memory", str(self.object_store_mb << 20),
               "--disable-usage-stats", "--no-monitor", "--include-log-monitor=false"]
        if i == 0:
            return [*cmd, "--head", "--port", str(self.port), "--include-dashboard=false",
                    "--dashboard-port", str(free_port(node.ip))]
        return [*cmd, "--address", self.address]

    def start(self, timeout_s: float = 120.0) -> LocalRayCluster:
        """Start every node at once (the others wait for the head's GCS) and wait until all are up."""
        procs = []
        try:
            for i, node in enumerate(self.nodes):
                log = open(self.root / f"start-{i}.log", "wb")
                with log:
                    p = subprocess.Popen(self._command(i, node), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
                node.session = p.pid
                procs.append(p)
            for i, p in enumerate(procs):
                if p.wait(timeout=timeout_s) != 0:
                    raise RuntimeError(f"ray start of node {i} failed:\n{self.log(i)}")
        except BaseException:
            self.stop()
            raise
        return self

    def log(self, i: int) -> str:
        return (self.root / f"start-{i}.log").read_text(errors="replace")[-3000:]

    def raylet_pid(self, i: int) -> int:
        """The pid of node ``i``'s raylet (the process whose command line names its temp dir)."""
        mark = str(self.root / f"n{i}").encode()
        for pid, cmd in _processes():
            if b"raylet/raylet" in cmd and mark in cmd:
                return pid
        raise LookupError(f"node {i} has no raylet")

    def processes(self) -> list[int]:
        """Every live process of every node (their sessions)."""
        sessions = {n.session for n in self.nodes if n.session}
        return [pid for pid, _ in _processes() if _session(pid) in sessions]

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM every process of the cluster's sessions, SIGKILL what is left after ``grace_s``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.processes()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace_s
            while pids and time.monotonic() < end:
                time.sleep(0.1)
                pids = self.processes()
        shutil.rmtree(self.root, ignore_errors=True)


def _processes() -> list[tuple[int, bytes]]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out.append((int(entry), Path(f"/proc/{entry}/cmdline").read_bytes()))
            except OSError:
                pass
    return out


def _session(pid: int) -> int | None:
    """The session id of ``pid`` (None if gone or a zombie, which has nothing left to end)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return None if fields[0] == "Z" else int(fields[3])


def free_port(host: str) -> int:
    """A port free now on ``host`` (of the 127.0.0.0/8 addresses the nodes use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
