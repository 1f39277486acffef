"""Shared fixtures: a real worker process on a free port, with helpers to read its /metrics.

``start_worker(*extra_args)`` starts ``fleetllm worker`` with the given extra flags and returns a
:class:`WorkerProcess` once ``/health`` says ok. Test modules get workers through fixtures (nothing
needs importing from here): ``worker`` is a default worker, one per module; ``worker_factory(*args)``
starts one with flags and stops it when the module ends, e.g.::

    @pytest.fixture(scope="module")
    def small_worker(worker_factory):
        return worker_factory("--max-model-len", "64")
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fleet_helpers import free_port, start_cli, stop_process

MODEL = "smollm2-135m"
STARTUP_TIMEOUT_S = 120.0


@dataclass
class WorkerProcess:
    base_url: str  # http://127.0.0.1:PORT (the OpenAI base URL is base_url + "/v1")
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        return scrape(self.base_url)

    def wait_for_metrics(self, ok: Callable[[dict[str, float]], bool], deadline_s: float = 30.0) -> dict[str, float]:
        return wait_for_metrics(self.base_url, ok, deadline_s)

    def wait_idle(self, deadline_s: float = 30.0) -> dict[str, float]:
        """Wait until nothing runs or waits and every KV block is free (fails after the deadline)."""
        return wait_for_metrics(self.base_url, idle, deadline_s)

    def stop(self) -> None:
        stop_process(self.process, timeout=15)
        self.log_path.unlink(missing_ok=True)


def start_worker(*extra_args: str) -> WorkerProcess:
    """Start a worker with ``extra_args`` on a free port; wait until it is healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = start_cli(["worker", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                   *extra_args], [url], timeout=STARTUP_TIMEOUT_S)
    return WorkerProcess(url, p.popen, p.log_path)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    """A worker with default flags, one per test module."""
    w = start_worker()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def worker_factory() -> Iterator[Callable[..., WorkerProcess]]:
    """``start(*extra_args)`` -> a started worker; every worker it started is stopped with the module."""
    started: list[WorkerProcess] = []

    def start(*extra_args: str) -> WorkerProcess:
        w = start_worker(*extra_args)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


# ---- /metrics -------------------------------------------------------------------------------------
def scrape(base_url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value}, labels dropped (a worker serves one model); samples
    sharing a name (e.g. request_success by reason) are summed."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if "_bucket" in name:
            continue
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_for_metrics(base_url: str, ok: Callable[[dict[str, float]], bool], deadline_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until ``ok`` holds; fail with the last values after a generous deadline."""
    end = time.monotonic() + deadline_s
    m = scrape(base_url)
    while not ok(m):
        if time.monotonic() > end:
            pytest.fail(f"metrics never satisfied the condition within {deadline_s}s: {m}")
        time.sleep(0.1)
        m = scrape(base_url)
    return m


def idle(m: dict[str, float]) -> bool:
    """No request running or waiting, and every KV block free."""
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0)
