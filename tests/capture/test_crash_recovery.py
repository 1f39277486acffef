"""Nothing answered is lost: the router and a worker are SIGKILLed mid-run while S3 is unreachable; after a
restart with S3 back, every answered request is in the endpoint and worker tiers, exactly once."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fleet_helpers import free_port, free_ports, start_cli

from fleetllm.capture.reader import CaptureSource

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Count to three"}], "max_tokens": 6}


def _fleet(started: list, capture: list[str], worker_port: int, router_port: int) -> str:
    """A simulated worker and a router, started side by side (each its own process)."""
    worker, router = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{router_port}"
    commands = [(["worker", "--simulate", "--count", "1", "--port", str(worker_port), "--sim-speed", "20",
                  "--log-level", "warning", *capture], [worker]),
                (["router", "--workers", worker, "--policy", "round_robin", "--port", str(router_port),
                  "--health-interval", "0.2", "--log-level", "warning", *capture], [router])]
    with ThreadPoolExecutor(2) as pool:
        started.extend(pool.map(lambda c: start_cli(*c, ready=(200, 503)), commands))
    end = time.monotonic() + 30
    while httpx.get(router + "/health", timeout=5).status_code != 200 and time.monotonic() < end:
        time.sleep(0.1)
    return router


def _ask(client: httpx.Client, url: str, i: int) -> httpx.Response:
    return client.post(url + "/v1/chat/completions", json={**CHAT, "stream": i % 2 == 0},
                       headers={"x-request-id": uuid.uuid4().hex})


@pytest.mark.slow
def test_sigkill_with_s3_down_then_restart_loses_no_answered_request(s3_server, procs, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)  # the children's credentials
    bucket = f"crash-{uuid.uuid4().hex[:12]}"
    s3_server.client("s3").create_bucket(Bucket=bucket)
    common = ["--capture-destination", f"s3://{bucket}/c", "--capture-spool-dir", str(tmp_path / "spool"),
              "--capture-batch-records", "5"]
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: S3 is down
    worker_port, router_port = free_ports(1), free_port()

    url = _fleet(procs, [*common, "--capture-s3-endpoint-url", down, "--capture-flush-interval", "0.2"],
                 worker_port, router_port)
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _ask(client, url, i), range(24)))
    answered = [a.headers["x-fleetllm-request-id"] for a in answers if a.status_code == 200]
    assert len(answered) == 24
    for p in procs:
        p.kill()  # SIGKILL: no flush, no upload
    procs.clear()

    # back up, with a flush interval so long that only SIGTERM ships what arrives from now on
    _fleet(procs, [*common, "--capture-s3-endpoint-url", s3_server.endpoint_url, "--capture-flush-interval", "600"],
           worker_port, router_port)
    source = CaptureSource(f"s3://{bucket}/c", s3_server.endpoint_url)
    end = time.monotonic() + 30
    while True:
        ids = Counter((t, r.get("request_id") or r["eventMetadata"]["inferenceId"]) for _, t, r in source.records())
        if all(ids[(t, i)] for t in ("endpoint", "worker", "access") for i in answered) or time.monotonic() > end:
            break
        time.sleep(0.3)
    for tier in ("endpoint", "worker", "access"):
        assert Counter({i: ids[(tier, i)] for i in answered}) == Counter(answered), tier  # each exactly once

    with httpx.Client(timeout=30) as client:
        late = [_ask(client, url, i).headers["x-fleetllm-request-id"] for i in range(3)]
    for p in procs:
        p.stop()  # SIGTERM flushes the open segments
    procs.clear()
    ids = Counter((t, r.get("request_id") or r["eventMetadata"]["inferenceId"]) for _, t, r in source.records())
    assert all(ids[(t, i)] == 1 for t in ("endpoint", "worker", "access") for i in late)
