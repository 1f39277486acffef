"""Graceful drain (SIGTERM on a worker) and a rolling restart of a fleet (``fleetllm fleet restart`` from
another process, which SIGHUPs ``fleetllm serve``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from fleet_helpers import free_ports, sim_worker_processes

from fleetllm.cli import build_parser

pytestmark = pytest.mark.slow  # processes: signals, exits, restarts


def _stream(url: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    body = {"prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        out["status"] = r.status_code
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
        out["lines"] = lines


def test_sigterm_drains_in_flight_requests_then_exits(procs) -> None:
    w = sim_worker_processes(1, "--sim-speed", "3")
    procs.append(w)
    started, out = threading.Event(), {}
    # long enough to outlast the checks below (the q4 profile decodes a token in ~12 ms: 40 tokens at speed 3 took
    # 0.16 s, and the worker could finish draining and exit before the POST: "connection refused")
    t = threading.Thread(target=_stream, args=(w.url, 400, started, out))
    t.start()
    assert started.wait(30)
    w.popen.send_signal(signal.SIGTERM)
    ready = httpx.get(w.url + "/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    new = httpx.post(w.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert new.status_code == 503 and new.headers["retry-after"]
    t.join(60)
    assert out["status"] == 200 and out["lines"][-1] == "[DONE]"
    finals = [c for line in out["lines"][:-1] for c in json.loads(line)["choices"] if c["finish_reason"]]
    assert [c["finish_reason"] for c in finals] == ["length"]
    assert w.popen.wait(timeout=30) == 0


def _post(url: str, body: dict, out: dict) -> None:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    out.update(status=r.status_code, body=r.json(), retry=r.headers.get("retry-after"))


def test_a_drain_out_of_time_answers_what_is_left(procs) -> None:
    """Past --drain-timeout the worker does not just stop (cutting connections): a request not yet answered
    gets 503 + Retry-After (a router retries it elsewhere), a stream under way an error event then [DONE]."""
    w = sim_worker_processes(1, "--sim-speed", "1", "--drain-timeout", "0.5", "--max-num-seqs", "1")
    procs.append(w)
    started, streamed, queued = threading.Event(), {}, {}
    stream = threading.Thread(target=_stream, args=(w.url, 1000, started, streamed))
    stream.start()
    assert started.wait(30)
    plain = threading.Thread(target=_post, args=(w.url, {"prompt": "Hi", "max_tokens": 5}, queued))
    plain.start()  # waits behind the stream: one sequence at a time
    time.sleep(0.3)
    w.popen.send_signal(signal.SIGTERM)
    stream.join(60)
    plain.join(60)
    assert streamed["status"] == 200 and streamed["lines"][-1] == "[DONE]"
    assert json.loads(streamed["lines"][-2])["error"]["code"] == 503
    assert queued["status"] == 503 and queued["retry"] and queued["body"]["error"]["message"]
    assert w.popen.wait(timeout=30) == 0


FLEET = """
machines:
  - {name: a, cores: 1, memory_gb: 4, zone: za}
  - {name: b, cores: 1, memory_gb: 4, zone: zb}
models:
  - {source: smollm2-135m, simulate: true, replicas: 2}
router_args: ["--health-interval", "0.25"]
"""


def _serve(config: Path, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    fd, name = tempfile.mkstemp(prefix="fleetllm-roll-", suffix=".log")
    p = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", "serve", "--config", str(config), "--port", str(port),
                          "--run-dir", str(config.parent), "--log-dir", str(config.parent / "logs")],
                         stdout=fd, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(fd)
    return p, Path(name)


def _wait_for(log: Path, text: str, p: subprocess.Popen[bytes], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert p.poll() is None and time.monotonic() < end, log.read_text(errors="replace")
        time.sleep(0.2)


def _load(url: str, stop: threading.Event, results: list[int], i: int) -> None:
    body = {"prompt": f"client {i} asks:", "max_tokens": 8, "ignore_eos": True, "stream": i % 2 == 0}
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            try:
                r = c.post(url + "/v1/completions", json=body)
                ok = r.status_code == 200 and (not body["stream"] or r.text.rstrip().endswith("data: [DONE]"))
                results.append(200 if ok and '"error"' not in r.text else r.status_code or 599)
            except httpx.HTTPError:
                results.append(599)


def test_a_rolling_restart_under_load_fails_no_request(tmp_path: Path, capsys) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    port = free_ports(3)
    p, log = _serve(config, port)
    stop, results = threading.Event(), []
    clients = [threading.Thread(target=_load, args=(f"http://127.0.0.1:{port}", stop, results, i)) for i in range(4)]
    try:
        _wait_for(log, "fleet ready", p)
        for t in clients:
            t.start()
        while len(results) < 4:
            time.sleep(0.1)
        # `fleetllm fleet restart` from this process, not the serve's: it finds the serve by its state file
        args = build_parser().parse_args(["fleet", "restart", "--run-dir", str(tmp_path), "--timeout", "300"])
        assert args.func(args) == 0
        assert "rolling restart done" in capsys.readouterr().out
        stop.set()
        for t in clients:
            t.join(60)
        assert log.read_text().count("rolling restart: ") == 2
        assert results and set(results) == {200}, f"{len(results)} requests, failed: {[r for r in results if r != 200]}"
    finally:
        stop.set()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.unlink(missing_ok=True)
    assert not (tmp_path / f"serve-{port}.json").exists()  # the serve removed its state file
