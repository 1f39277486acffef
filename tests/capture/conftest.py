"""Capture fixtures: a fleet in-process (simulated workers, each a full Worker app, and a router), with
capture on at every tier, and helpers to flush and read back what it captured."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fleet_helpers import (
    ADMIN,
    ADMIN_TOKEN_FILE,
    ThreadServer,
    ThreadServers,
    procs,  # noqa: F401  (fixture)
)

from fleetllm.capture.config import CaptureConfig
from fleetllm.capture.reader import CaptureSource
from fleetllm.capture.recorder import Capture

MODEL = "smollm2-135m"


@dataclass
class CaptureFleet:
    """A router over simulated workers, every process capturing to ``cfg.destination``."""

    router_url: str
    captures: list[Capture]
    servers: list[ThreadServers]
    cfg: CaptureConfig

    def flush(self) -> None:
        """Seal and ship everything captured so far."""
        for c in self.captures:
            c.spool.seal_due(0)
            assert c.uploader.drain(), "a capture upload failed"

    def records(self, tier: str, endpoint_url: str | None = None) -> list[dict[str, Any]]:
        self.flush()
        return [r for _, _, r in CaptureSource(self.cfg.destination, endpoint_url).records(tier)]

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()


@pytest.fixture(scope="module")
def capture_fleet() -> Iterator[Callable[..., CaptureFleet]]:
    """``start(**capture settings)`` -> a started fleet (2 simulated workers); all stopped with the module."""
    from fleetllm.cli import build_parser, router_config
    from fleetllm.router.gateway import Router
    from fleetllm.sim.config import SimConfig
    from fleetllm.sim.server import build_workers

    started: list[CaptureFleet] = []

    def start(workers: int = 2, sink: Any = None, **settings: Any) -> CaptureFleet:
        cfg = CaptureConfig(flush_interval_s=0.2, **settings)
        sims = build_workers(MODEL, workers, SimConfig(model_name=MODEL, speed=20.0), None)
        caps = []
        for i, w in enumerate(sims):
            w.capture = Capture(cfg, f"worker-{i}", ("worker",), w.engine.metrics.registry, sink=sink)
            caps.append(w.capture)
        ws = ThreadServers([w.app for w in sims], on_exit=lambda: [setattr(w, "closing", True) for w in sims]).start()
        args = build_parser().parse_args(["router", "--workers", ",".join(ws.urls), "--policy", "round_robin",
                                          "--health-interval", "0.2", "--admin-token-file", ADMIN_TOKEN_FILE])
        r = Router(router_config(args))
        r.capture = Capture(cfg, "router", ("endpoint", "access"), r.metrics.registry, sink=sink)
        rs = ThreadServer(r.app, on_exit=lambda: setattr(r, "closing", True)).start()
        fleet = CaptureFleet(rs.url, [r.capture, *caps], [ws, rs], cfg)
        started.append(fleet)
        _wait_healthy(rs.url)
        return fleet

    yield start
    for f in started:
        f.stop()


def _wait_healthy(url: str) -> None:
    import time

    import httpx

    end = time.monotonic() + 20
    while time.monotonic() < end:
        state = httpx.get(url + "/router/state", headers=ADMIN, timeout=5).json()
        if all(w.get("healthy") for w in state.get("workers", [])):
            return
        time.sleep(0.05)
    pytest.fail("router never saw its workers healthy")


@pytest.fixture
def aws(s3_server, monkeypatch: pytest.MonkeyPatch):
    """boto3 in this process talks to the session's S3 + KMS endpoint; a fresh bucket and KMS key."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    bucket = f"capture-{uuid.uuid4().hex[:12]}"
    s3_server.client("s3").create_bucket(Bucket=bucket)
    key_id = s3_server.client("kms").create_key()["KeyMetadata"]["KeyId"]
    return s3_server, bucket, key_id
