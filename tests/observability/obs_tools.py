"""Test tools for the observability end-to-end tests: a real Prometheus server, headless Chromium
driven through chromedriver, and ``fleetllm bench`` runs. Everything binds 127.0.0.1 and is stopped
by the test that started it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fleet_helpers import free_port, free_ports, stop_process

ROOT = Path(__file__).resolve().parents[2]


class Fleet:
    """``fleetllm serve --config`` (a router and its workers) on consecutive free ports."""

    def __init__(self, config: dict[str, Any], replicas: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fleetllm-fleet-"))
        self.log_dir = self.dir / "logs"  # the router's and each worker's log
        (self.dir / "fleet.yaml").write_text(yaml.safe_dump({**config, "log_dir": str(self.log_dir)}))
        self.port = free_ports(1 + replicas)
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_urls = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(replicas)]
        self.log_path = self.dir / "serve.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", "serve", "--config", str(self.dir / "fleet.yaml"),
                                      "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        end = time.monotonic() + 300
        while "fleet ready" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"fleet did not become ready:\n{self.log()}")
            time.sleep(0.3)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc, timeout=60, kill_timeout=15)
        shutil.rmtree(self.dir, ignore_errors=True)


def artifacts_dir(*parts: str) -> Path:
    base = Path(os.environ.get("FLEETLLM_ARTIFACTS") or ROOT / "test-artifacts")
    d = base.joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    return d


def need(binary: str) -> str:
    path = shutil.which(binary) or (f"/usr/bin/{binary}" if os.path.exists(f"/usr/bin/{binary}") else None)
    if path is None:
        pytest.fail(f"{binary} is not installed: run scripts/setup.sh (it installs the Debian package)")
    return path


def run_bench(url: str, out: Path, *args: str) -> dict[str, Any]:
    """``fleetllm bench`` against ``url``; returns its result JSON (fails the test on a non-zero exit)."""
    cmd = [sys.executable, "-m", "fleetllm.cli", "bench", "--url", url, "--model", "smollm2-135m",
           "--no-progress", "--output", str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text())


class Prometheus:
    """A Prometheus server scraping ``targets`` every second, with storage in a temp dir."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fleetllm-prom-"))
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [need("prometheus"), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited:\n" + (self.dir / "prometheus.log").read_text())
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("prometheus not ready after 60 s")

    @staticmethod
    def scraping(targets: list[str], interval: str = "1s") -> dict[str, Any]:
        return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
                "scrape_configs": [{"job_name": "fleetllm", "static_configs": [{"targets": targets}]}]}

    def query(self, promql: str) -> dict[str, Any]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        return r.json()

    def vector(self, promql: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The instant vector as {sorted label pairs: value}; fails the test if the query fails."""
        got = self.query(promql)
        assert got["status"] == "success", (promql, got)
        return {tuple(sorted(x["metric"].items())): float(x["value"][1]) for x in got["data"]["result"]}

    def scalar(self, promql: str) -> float | None:
        v = self.vector(promql)
        return next(iter(v.values())) if len(v) == 1 else None

    def wait_for(self, promql: str, ok: Any, deadline_s: float = 60.0) -> dict:
        end = time.monotonic() + deadline_s
        while True:
            v = self.vector(promql)
            if ok(v):
                return v
            if time.monotonic() > end:
                pytest.fail(f"{promql} never satisfied the condition: {v}")
            time.sleep(0.5)

    def stop(self) -> None:
        stop_process(self.proc, timeout=15)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (Debian's, via /usr/bin/chromedriver) that keeps the page's console log."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="fleetllm-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = need("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1000"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=need("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def points(driver: Any, card: str) -> int:
    """Chart points (or table rows) on a dashboard card; 0 while the card is not on the page yet: a tab's click
    builds its view on the next hashchange event, which can come after the click returns."""
    cards = driver.find_elements("id", "card-" + card)
    return int(cards[0].get_attribute("data-points")) if cards else 0
