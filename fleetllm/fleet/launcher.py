"""Start, watch and stop a fleet: N worker processes and a router process on one machine.

Start order: workers (real ones share the cores evenly; simulated ones run up to ``SIM_PER_PROCESS``
per process), wait until each answers /health, then the router, then wait until the router sees
every worker healthy. On SIGINT/SIGTERM the router stops first (no new requests), then the workers;
anything still alive after a grace period is killed, so no process outlives the fleet. With
``restart`` a worker process that dies is started again on the same port; the router notices the
new instance through its KV-event stream and re-syncs its prefix index.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetllm.fleet.config import FleetConfig

log = logging.getLogger(__name__)
SIM_PER_PROCESS = 64


@dataclass
class Proc:
    name: str
    cmd: list[str]
    urls: list[str]  # the base URLs this process serves
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    def start(self) -> None:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.popen = subprocess.Popen(self.cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
        finally:
            os.close(fd)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Fleet:
    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="fleetllm-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: list[Proc] = []
        self.zones: list[str] = []
        self.roles: list[str] = []
        self.router: Proc | None = None
        self._plan()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def worker_urls(self) -> list[str]:
        return [u for p in self.workers for u in p.urls] + list(self.cfg.external)

    def _plan(self) -> None:
        cfg = self.cfg
        py = [sys.executable, "-m", "fleetllm.cli"]
        port = cfg.worker_port or cfg.port + 1
        real = sum(g.replicas for g in cfg.workers if not g.simulate)
        cores = os.cpu_count() or 1
        otlp = ["--otlp-endpoint", cfg.otlp_endpoint] if cfg.otlp_endpoint else []
        for gi, g in enumerate(cfg.workers):
            # the `zone` label on the worker's own metrics, and where it pushes OTLP
            obs_flags = (["--zone", g.zone] if g.zone else []) + otlp
            if g.simulate:
                left = g.replicas
                while left:
                    n = min(left, SIM_PER_PROCESS)
                    urls = [f"http://{cfg.host}:{port + i}" for i in range(n)]
                    cmd = [*py, "worker", "--simulate", "--count", str(n), "--model", g.model, "--host", cfg.host,
                           "--port", str(port), "--log-level", "warning", *obs_flags, *g.args]
                    self.workers.append(Proc(f"sim{gi}-{port}", cmd, urls, self.log_dir / f"sim-{port}.log"))
                    self.zones += [g.zone] * n
                    self.roles += ["both"] * n
                    port += n
                    left -= n
                continue
            threads = g.threads or max(1, cores // max(1, real))
            for _ in range(g.replicas):
                cmd = [*py, "worker", "--model", g.model, "--host", cfg.host, "--port", str(port),
                       "--num-threads", str(threads), "--role", g.role, "--log-level", "warning", *obs_flags,
                       *g.args]
                self.workers.append(Proc(f"worker-{port}", cmd, [f"http://{cfg.host}:{port}"],
                                         self.log_dir / f"worker-{port}.log"))
                self.zones.append(g.zone)
                self.roles.append(g.role)
                port += 1
        self.zones += [""] * len(cfg.external)
        self.roles += ["both"] * len(cfg.external)
        rcmd = [*py, "router", "--workers", ",".join(self.worker_urls), "--policy", cfg.policy, "--host", cfg.host,
                "--port", str(cfg.port), "--log-level", "warning", *otlp, *cfg.router_args]
        if any(self.zones):
            rcmd += ["--zones", ",".join(self.zones)]
        if any(r != "both" for r in self.roles):
            rcmd += ["--roles", ",".join(self.roles)]
        if cfg.pd_threshold is not None:
            rcmd += ["--pd-threshold", str(cfg.pd_threshold)]
        self.router = Proc("router", rcmd, [self.url], self.log_dir / "router.log")

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything and return once the router sees every worker healthy (raises otherwise)."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        try:
            for p in self.workers:
                p.start()
            for p in self.workers:
                for u in p.urls:
                    self._wait_healthy(p, u + "/health", deadline)
            assert self.router is not None
            self.router.start()
            self._wait_healthy(self.router, self.url + "/health", deadline)
            self._wait_router_sees_all(deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, p: Proc, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode if p.popen else '?'}:\n{p.log_tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{p.name} not healthy in time ({url}):\n{p.log_tail()}")

    def _wait_router_sees_all(self, deadline: float) -> None:
        n = len(self.worker_urls)
        while time.monotonic() < deadline:
            try:
                state = httpx.get(self.url + "/router/state", timeout=2).json()
                if sum(w["healthy"] for w in state["workers"]) == n:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise TimeoutError("the router did not see every worker healthy in time")

    def stop(self, grace_s: float = 20.0) -> None:
        """Router first, then workers: SIGTERM, wait, then SIGKILL whatever is left."""
        groups = [[self.router] if self.router else [], self.workers]
        for group in groups:
            live = [p for p in group if p.alive]
            for p in live:
                p.popen.terminate()  # type: ignore[union-attr]
            end = time.monotonic() + grace_s
            for p in live:
                try:
                    p.popen.wait(timeout=max(0.1, end - time.monotonic()))  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0fs: killed", p.name, grace_s)
                    os.killpg(p.popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
                    p.popen.wait()  # type: ignore[union-attr]

    def supervise(self, should_stop: callable) -> None:  # type: ignore[valid-type]
        """Block until ``should_stop()``; restart dead workers when configured to."""
        while not should_stop():
            for p in self.workers:
                if not p.alive and self.cfg.restart:
                    p.restarts += 1
                    log.warning("%s exited (%s); restarting (restart %d)", p.name,
                                p.popen.returncode if p.popen else "?", p.restarts)
                    p.start()
            if self.router is not None and not self.router.alive:
                log.error("the router exited:\n%s", self.router.log_tail())
                return
            time.sleep(0.5)


def run_fleet(cfg: FleetConfig) -> int:
    """``fleetllm serve``: start the fleet, serve until SIGINT/SIGTERM, stop it cleanly."""
    fleet = Fleet(cfg)
    stop = {"now": False}

    def on_signal(sig: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    n = cfg.num_workers
    print(f"starting {n} worker(s) and the router (logs in {fleet.log_dir}) ...", flush=True)
    t0 = time.monotonic()
    try:
        fleet.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"fleet failed to start: {e}", file=sys.stderr)
        return 1
    print(f"fleet ready in {time.monotonic() - t0:.1f}s: {fleet.url}/v1 (policy {cfg.policy}, {n} workers: "
          f"{', '.join(fleet.worker_urls[:4])}{' ...' if n > 4 else ''})", flush=True)
    try:
        fleet.supervise(lambda: stop["now"])
    finally:
        fleet.stop()
    return 0
