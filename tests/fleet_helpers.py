"""Fleets for tests: simulated workers, routers and fake upstreams served in-process on free ports, and real
processes for the tests about processes (imported by router and disaggregation tests; the `procs` fixture is
re-exported by their conftest).

In-process servers are the apps ``fleetllm worker --simulate`` and ``fleetllm router`` build from the same
flags, served by uvicorn on a thread of the test process; ``*_processes`` start the CLI itself, for tests
that kill or restart a process.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import shutil
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
from typing import Any
from unittest import mock

import httpx
import pytest
import uvicorn

# The admin token of every router the tests start (in-process, `fleetllm router`, `fleetllm serve`): one file for
# the test process, removed when it exits; ADMIN is what a test sends to /admin/* and /router/state.
_ADMIN_DIR = tempfile.mkdtemp(prefix="fleetllm-test-admin-")
atexit.register(shutil.rmtree, _ADMIN_DIR, True)
ADMIN_TOKEN_FILE = os.path.join(_ADMIN_DIR, "admin-token")
# the logs of the processes tests start: one folder per test process, removed when it ends
LOG_DIR = tempfile.mkdtemp(prefix="fleetllm-test-logs-")
atexit.register(shutil.rmtree, LOG_DIR, True)


def _admin() -> dict[str, str]:
    from fleetllm.router.admin_token import admin_headers, mint_token

    mint_token(ADMIN_TOKEN_FILE)
    return admin_headers(ADMIN_TOKEN_FILE)


ADMIN = _admin()


def with_admin_token(args: list[str]) -> list[str]:
    """``fleetllm router`` / ``serve`` arguments with the tests' admin token file unless they name one."""
    return args if "--admin-token-file" in args else [*args, "--admin-token-file", ADMIN_TOKEN_FILE]


# Workers in tests get a quarter GiB of KV cache (5.8k tokens) unless their flags size it: the default GiB is
# zeroed page by page at every start, which on a busy machine costs more than the tests' requests.
TEST_KV_GB = 0.25


def kv_sized(flags: tuple[str, ...]) -> tuple[str, ...]:
    """Worker ``flags`` with the tests' KV cache size unless they give one."""
    return flags if {"--kv-cache-gb", "--num-blocks"} & set(flags) else ("--kv-cache-gb", str(TEST_KV_GB), *flags)


def listening(url: str) -> bool:
    """Whether anything answers HTTP at ``url`` (a stopped server's port refuses connections)."""
    try:
        httpx.get(url + "/health", timeout=1)
        return True
    except httpx.TransportError:
        return False


# Ports handed out to this test process: a range of its own below Linux's ephemeral ports (32768 and up), walked
# in order. Asking the kernel for port 0 and closing it raced: another xdist process, or a server it started,
# could bind the same ephemeral port before ours did ("address already in use", about 1 full run in 8).
_SPAN = 1500
_FIRST = 20000 + _SPAN * (int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 8)
_next = itertools.count()


def free_ports(n: int = 1) -> int:
    """The first of ``n`` consecutive ports that are free now, from this process's own range (simulated workers
    take consecutive ports); a port is not handed out twice while the range lasts."""
    for _ in range(_SPAN):
        base = _FIRST + next(_next) % (_SPAN - n)
        for _ in range(n - 1):
            next(_next)
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


def free_port() -> int:
    """A port that is free now, from this process's own range."""
    return free_ports(1)


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
    fd, name = tempfile.mkstemp(prefix="fleetllm-test-", suffix=".log", dir=LOG_DIR)
    if args[0] in ("router", "serve"):
        args = with_admin_token(args)
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


def sim_worker_processes(count: int, *extra: str, port: int | None = None) -> Proc:
    """``fleetllm worker --simulate --count COUNT`` as a process (for tests that kill or restart it), at
    ``SIM_SPEED`` unless EXTRA sets ``--sim-speed``."""
    port = port or free_ports(count)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(count)]
    return start_cli(["worker", "--simulate", "--count", str(count), "--port", str(port), "--log-level", "warning",
                      *_sim_flags(extra)], urls)


SIM_SPEED = "10"  # simulated workers run their timing model this much faster unless a test asks otherwise


def _sim_flags(extra: tuple[str, ...]) -> tuple[str, ...]:
    return extra if "--sim-speed" in extra else (*extra, "--sim-speed", SIM_SPEED)


def sim_workers(count: int, *extra: str) -> ThreadServers:
    """What ``fleetllm worker --simulate --count COUNT EXTRA`` serves, in-process: the CLI maps the flags
    (its call to ``serve_simulated`` is caught), the apps run on one thread of the test process. The timing
    model runs ``SIM_SPEED`` times faster than real time unless EXTRA sets ``--sim-speed``."""
    from fleetllm.cli import build_parser
    from fleetllm.sim.server import build_workers

    port = free_ports(count)
    args = build_parser().parse_args(["worker", "--simulate", "--count", str(count), "--host", "127.0.0.1",
                                      "--port", str(port), *_sim_flags(extra)])
    caught: dict[str, Any] = {}

    def serve_simulated(model, host, port, count, cfg, profile, log_level="warning", identities=None, obs=None,
                        drain_timeout_s=30.0, lora=None, store=None, **listen):
        caught.update(model=model, count=count, cfg=cfg, profile=profile, identities=identities, obs=obs, lora=lora,
                      store=store)

    with mock.patch("fleetllm.sim.server.serve_simulated", serve_simulated):
        args.func(args)
    workers = build_workers(**caught)

    def closing() -> None:
        for w in workers:
            w.closing = True

    return ThreadServers([w.app for w in workers], port, on_exit=closing).start()


def real_worker(*extra: str) -> Proc:
    """A real engine worker process (one torch thread) on a free port."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start_cli(["worker", "--model", "smollm2-135m", "--port", str(port), "--num-threads", "1",
                      "--log-level", "warning", *kv_sized(extra)], [url], timeout=240)


def router(workers: list[str], policy: str = "kv_aware", *extra: str) -> ThreadServers:
    """What ``fleetllm router --workers W --policy P EXTRA`` serves, in-process (health checks every 0.5 s); it
    listens, so this returns, once each worker has answered its first health check."""
    from fleetllm.cli import build_parser, router_config
    from fleetllm.router.gateway import Router

    port = free_port()
    args = build_parser().parse_args(["router", "--workers", ",".join(workers), "--policy", policy, "--host",
                                      "127.0.0.1", "--port", str(port), "--health-interval", "0.5",
                                      *with_admin_token(list(extra))])
    assert not args.otlp_endpoint, "an in-process router pushes no OTLP: start `fleetllm router` for that"
    r = Router(router_config(args))
    return ThreadServers([r.app], port, on_exit=lambda: setattr(r, "closing", True), startup_timeout=30).start()


def wait_state(router_url: str, ok: Callable[[dict], bool], deadline_s: float = 20.0) -> dict:
    end = time.monotonic() + deadline_s
    while True:
        state = httpx.get(router_url + "/router/state", headers=ADMIN, timeout=5).json()
        if ok(state):
            return state
        if time.monotonic() > end:
            pytest.fail(f"router state never satisfied the condition: {state}")
        time.sleep(0.1)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes and in-process servers a test starts; every one is stopped when the test ends."""
    started: list[Proc | ThreadServers] = []
    yield started
    for p in reversed(started):
        p.stop()
        if isinstance(p, Proc):
            p.log_path.unlink(missing_ok=True)


class ThreadServers:
    """ASGI apps served by uvicorn on consecutive ports, all on one thread (one event loop) of the test
    process: in-process workers and routers, and fake upstreams.

    ``on_exit`` runs before the servers are asked to stop: a Worker or Router ends its endless streams
    (/kv/events, upstream subscriptions) when its ``closing`` is set, as ``fleetllm.server.uvicorn_runner`` does
    on SIGTERM. Lifespans run for real ("on": a failing start-up fails the test, not its requests).
    """

    def __init__(self, apps: list[Any], port: int | None = None, on_exit: Callable[[], object] | None = None,
                 startup_timeout: float = 10.0) -> None:
        port = port or (free_port() if len(apps) == 1 else free_ports(len(apps)))
        self.urls = [f"http://127.0.0.1:{port + i}" for i in range(len(apps))]
        self.on_exit = on_exit
        self.startup_timeout = startup_timeout
        self.servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port + i, log_level="warning",
                                                      lifespan="on", access_log=False, timeout_graceful_shutdown=10))
                        for i, app in enumerate(apps)]
        self.thread = threading.Thread(target=self._run, name=f"uvicorn-{port}", daemon=True)

    def _run(self) -> None:
        async def serve_all() -> None:
            await asyncio.gather(*(s.serve() for s in self.servers))

        asyncio.run(serve_all())

    @property
    def url(self) -> str:
        return self.urls[0]

    def __enter__(self) -> ThreadServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ThreadServers:
        self.thread.start()
        end = time.monotonic() + self.startup_timeout
        while not all(s.started for s in self.servers):
            if not self.thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"in-process servers on {self.urls} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.on_exit is not None:
            self.on_exit()
        for s in self.servers:
            s.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), f"in-process servers on {self.urls} did not stop"


class ThreadServer(ThreadServers):
    """One ASGI app served in-process (see :class:`ThreadServers`); use as a context manager."""

    def __init__(self, app: Any, port: int | None = None, on_exit: Callable[[], object] | None = None,
                 startup_timeout: float = 10.0) -> None:
        super().__init__([app], port, on_exit, startup_timeout)


def stop_process(popen: subprocess.Popen, timeout: float, kill_timeout: float | None = None) -> None:
    """SIGTERM ``popen`` if it still runs and wait; SIGKILL it if it has not exited after ``timeout`` s."""
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=timeout if kill_timeout is None else kill_timeout)


def smollm2_adapter(path: Path, seed: int, rank: int = 2) -> str:
    """A PEFT LoRA adapter at SmolLM2-135M's shapes (q_proj and v_proj of its 30 layers, small random A and B, 0.5 MB
    at rank 2) written to ``path``: what real and simulated workers over that model load. Its directory, as a str."""
    from lora.lora_models import write_adapter

    write_adapter(path, {"q_proj": (576, 576), "v_proj": (576, 192)}, 30, ["q_proj", "v_proj"], rank, 2 * rank, seed)
    return str(path)
