"""Processes for fleet tests: real and simulated workers, routers and fake upstreams on free ports (imported by
router and disaggregation tests; the `procs` fixture is re-exported by their conftest)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (simulated workers take consecutive ports)."""
    for _ in range(200):
        base = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log_path: Path
    urls: list[str]

    @property
    def url(self) -> str:
        return self.urls[0]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        stop_process(self.popen, timeout=20)


def start_cli(args: list[str], urls: list[str], timeout: float = 120.0, ready: tuple[int, ...] = (200,)) -> Proc:
    """Run ``fleetllm ARGS``; return once each of ``urls`` answers /health with a status in ``ready``."""
    fd, name = tempfile.mkstemp(prefix="fleetllm-test-", suffix=".log")
    popen = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", *args], stdout=fd, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(fd)
    p = Proc(popen, Path(name), urls)
    end = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        if popen.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with {popen.returncode}:\n{p.log()}")
        if time.monotonic() > end:
            p.stop()
            raise RuntimeError(f"{args[0]} not healthy in {timeout}s:\n{p.log()}")
        try:
            if httpx.get(pending[0] + "/health", timeout=2).status_code in ready:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return p


def sim_workers(count: int, *extra: str, port: int | None = None) -> Proc:
    port = port or free_ports(count)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(count)]
    return start_cli(["worker", "--simulate", "--count", str(count), "--port", str(port), "--log-level", "warning",
                      *extra], urls)


def real_worker(*extra: str) -> Proc:
    """A real engine worker (one torch thread) on a free port."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start_cli(["worker", "--model", "smollm2-135m", "--port", str(port), "--num-threads", "1",
                      "--log-level", "warning", *extra], [url], timeout=240)


def router(workers: list[str], policy: str = "kv_aware", *extra: str) -> Proc:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = start_cli(["router", "--workers", ",".join(workers), "--policy", policy, "--port", str(port),
                   "--health-interval", "0.5", "--log-level", "info", *extra], [url], ready=(200, 503))
    return p


def wait_state(router_url: str, ok: Callable[[dict], bool], deadline_s: float = 20.0) -> dict:
    end = time.monotonic() + deadline_s
    while True:
        state = httpx.get(router_url + "/router/state", timeout=5).json()
        if ok(state):
            return state
        if time.monotonic() > end:
            pytest.fail(f"router state never satisfied the condition: {state}")
        time.sleep(0.1)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts; every one is stopped when the test ends."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()
        p.log_path.unlink(missing_ok=True)


class ThreadServer:
    """An ASGI app served by uvicorn on a thread of the test process (for fake upstream workers)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > end:
                raise RuntimeError("fake upstream did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def stop_process(popen: subprocess.Popen, timeout: float, kill_timeout: float | None = None) -> None:
    """SIGTERM ``popen`` if it still runs and wait; SIGKILL it if it has not exited after ``timeout`` s."""
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=timeout if kill_timeout is None else kill_timeout)
