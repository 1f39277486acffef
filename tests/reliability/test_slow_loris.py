"""Slow-loris clients: a connection that trickles its request headers, or sends none, is answered 408 and
closed after the header timeout; requests whose headers arrive in time, kept-alive connections idle
between requests, and streams far longer than the timeout are untouched. Worker and router alike (both
are served by ``fleetllm.server.uvicorn_runner``, with the timeout from ``--header-timeout``)."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fleet_helpers import free_port

from fleetllm.cli import build_parser, router_config, sim_config
from fleetllm.router.gateway import Router
from fleetllm.server.uvicorn_runner import make_server
from fleetllm.sim.server import build_workers

TIMEOUT_S = 0.25
REQUEST = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


def _serve(app, port: int, on_exit) -> tuple[object, threading.Thread]:
    server = make_server(app, "127.0.0.1", port, "warning", on_exit=on_exit, header_timeout_s=TIMEOUT_S)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end
        time.sleep(0.02)
    return server, thread


@pytest.fixture(scope="module", params=["worker", "router"])
def url(request, sim) -> Iterator[str]:
    """A simulated worker, or a router over the session's, served as ``fleetllm worker|router`` serve them."""
    port = free_port()
    if request.param == "worker":
        args = build_parser().parse_args(["worker", "--simulate", "--sim-speed", "4"])
        (w,) = build_workers(args.model, 1, sim_config(args), None)
        app, closing = w.app, lambda: setattr(w, "closing", True)
    else:
        args = build_parser().parse_args(["router", "--workers", sim.url, "--port", str(port),
                                          "--header-timeout", str(TIMEOUT_S)])
        assert args.header_timeout_s == TIMEOUT_S
        r = Router(router_config(args))
        app, closing = r.app, lambda: setattr(r, "closing", True)
    server, thread = _serve(app, port, closing)
    if request.param == "router":  # started whole: its tokenizer loaded (on a thread, holding the GIL at times)
        end = time.monotonic() + 30
        while not r.tokens.loaded("smollm2-135m") and time.monotonic() < end:
            time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.exit_now()
    thread.join(30)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def _response(s: socket.socket) -> bytes:
    """One whole response on a kept-alive connection (head and its content-length body); the head."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(4096)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(4096)
    return head


def test_trickled_headers_get_408_and_the_connection_closed(url: str) -> None:
    s = _connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
    for _ in range(400):  # the header's value a byte every 25 ms: never done before the timeout
        if select.select([s], [], [], 0.025)[0]:
            break
        s.sendall(b"y")
    # the server answered and closed: recv ends (a socket timeout here would fail the test)
    assert _read_until_closed(s).startswith(b"HTTP/1.1 408")


def test_a_connection_that_sends_nothing_is_closed(url: str) -> None:
    s = _connect(url)
    assert _read_until_closed(s).startswith(b"HTTP/1.1 408")


def test_requests_in_time_and_idle_keep_alive_are_untouched(url: str) -> None:
    s = _connect(url)
    s.sendall(REQUEST)
    assert _response(s).startswith(b"HTTP/1.1 200")
    time.sleep(2 * TIMEOUT_S)  # idle between requests: the keep-alive timeout's business, not this one's
    s.sendall(REQUEST)
    assert _response(s).startswith(b"HTTP/1.1 200")
    s.close()


def test_a_stream_longer_than_the_timeout_completes(url: str) -> None:
    body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}  # ~2 s at q4's ~110 tok/s
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert time.monotonic() - t0 > TIMEOUT_S  # the premise, not a latency goal: it outlived the timeout
