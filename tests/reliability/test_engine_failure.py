"""A failing engine thread: every in-flight client gets a clean error, readiness fails, the process exits
non-zero (and ``fleetllm serve`` restarts it by default); liveness and readiness are separate probes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from unittest import mock

import httpx
import pytest
from fleet_helpers import ThreadServer, free_port, router, sim_workers, wait_state
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleetllm.engine.detokenizer import IncrementalDetokenizer

LONG = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True}


def _fail(*args, **kwargs):
    raise RuntimeError("injected detokeniser fault")


def _stream_events(url: str, started: threading.Event, out: list[str]) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                started.set()


def test_a_dead_engine_thread_fails_every_in_flight_request_cleanly(procs) -> None:
    s = sim_workers(1)
    procs.append(s)
    started, events, answers = threading.Event(), [], []
    streaming = threading.Thread(target=_stream_events, args=(s.url, started, events))
    plain = threading.Thread(target=lambda: answers.append(httpx.post(s.url + "/v1/completions", json=LONG, timeout=30)))
    streaming.start()
    assert started.wait(30)
    plain.start()
    time.sleep(0.3)  # let the second request reach the engine (it fails either way: queued or running)
    with mock.patch.object(IncrementalDetokenizer, "push", _fail):
        streaming.join(30)
        plain.join(30)
    assert not streaming.is_alive() and not plain.is_alive(), "a client hangs"
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and "injected detokeniser fault" in err["message"]
    (r,) = answers
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    assert httpx.get(s.url + "/ready").status_code == 503
    later = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert later.status_code == 500 and "engine failed" in later.json()["error"]["message"]


@pytest.mark.slow
def test_the_worker_process_exits_non_zero_when_its_engine_thread_dies(procs) -> None:
    port = free_port()
    script = ("import sys; from unittest import mock; from fleetllm.cli import main; "
              "from fleetllm.engine.detokenizer import IncrementalDetokenizer as D; "
              "mock.patch.object(D, 'push', side_effect=RuntimeError('injected')).start(); "
              f"sys.exit(main(['worker', '--simulate', '--port', '{port}', '--log-level', 'warning']))")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.poll() is None and time.monotonic() < end, "the worker did not start"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 500
        assert p.wait(timeout=30) != 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_liveness_and_readiness_are_separate_probes(sim) -> None:
    assert httpx.get(sim.url + "/health").json() == {"status": "ok"}
    assert httpx.get(sim.url + "/ready").json() == {"status": "ready"}


def _fake_worker(ready_status: int):
    async def health(request):
        return JSONResponse({"status": "ok"})

    async def ready(request):
        return JSONResponse({"status": "draining"}, status_code=ready_status)

    return Starlette(routes=[Route("/health", health), Route("/ready", ready)])


def test_the_router_routes_by_readiness_not_liveness(procs) -> None:
    alive_not_ready = ThreadServer(_fake_worker(503)).start()
    procs.append(alive_not_ready)
    real = sim_workers(1)
    procs.append(real)
    r = router([alive_not_ready.url, *real.urls], "round_robin")
    procs.append(r)
    state = wait_state(r.url, lambda st: any(w["healthy"] for w in st["workers"]))
    assert [w["healthy"] for w in state["workers"]] == [False, True]
    for _ in range(4):
        resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200 and resp.headers["x-fleetllm-worker"] == real.urls[0].removeprefix("http://")


def test_fleetllm_serve_restarts_dead_workers_by_default() -> None:
    from fleetllm.cli import build_parser, fleet_config

    assert fleet_config(build_parser().parse_args(["serve", "--simulate"])).restart is True
    assert fleet_config(build_parser().parse_args(["serve", "--simulate", "--no-restart"])).restart is False
