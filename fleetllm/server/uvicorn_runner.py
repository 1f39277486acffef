"""Run an ASGI app with uvicorn, telling the app when shutdown starts, draining first on SIGTERM.

Endless streams (a worker's /kv/events, a router's upstream subscriptions) must end when the server
is asked to stop, or uvicorn would wait for them forever; ``on_exit`` runs when shutdown starts.
With ``drain``, the first SIGTERM does not stop the server at once: the server keeps answering (a
draining worker's ``/ready`` says so, new requests get 503) while ``drain()`` lets in-flight requests
finish, then it stops. A second SIGTERM, or SIGINT, stops it at once.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from fleetllm.server.header_timeout import DEFAULT_HEADER_TIMEOUT_S, header_timeout_protocol


class FrozenHeapServer(uvicorn.Server):
    """A uvicorn server that moves every object alive when it starts (the imports, the app, the model's Python
    side) out of the garbage collector's view for good, just before it serves (every fleetllm server is one).

    Without it, the first full collection while serving walks that whole heap with the event loop stopped:
    a router's took 60-125 ms on a busy 2-core host, once in each router's life, and every request in flight
    then (the interactive TTFT's p99 in the fair-serving benchmark) waited for it. Cyclic garbage made before
    the start is kept rather than collected: start-up makes a fixed amount of it, not a growing one."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        gc.freeze()
        await super().startup(sockets)


class _Server(FrozenHeapServer):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None,
                 drain: Callable[[], Awaitable[object]] | None) -> None:
        super().__init__(config)
        self.on_exit, self.drain = on_exit, drain
        self.drain_requested = False
        self._drain_task: asyncio.Task[object] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain is not None and not self.drain_requested:
            self.drain_requested = True  # on_tick starts the drain on the event loop
            return
        if self.on_exit is not None:
            self.on_exit()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self._drain_task is None and self.drain is not None:
            self._drain_task = asyncio.ensure_future(self.drain())
        if self._drain_task is not None and self._drain_task.done() and not self.should_exit:
            if self.on_exit is not None:
                self.on_exit()
            self.should_exit = True
        return await super().on_tick(counter)

    def exit_now(self) -> None:
        """Stop as on SIGINT (from a thread or the loop: uvicorn polls the flag)."""
        self.handle_exit(signal.SIGINT, None)


@dataclass(frozen=True)
class TLSFiles:
    """A server's certificate chain and private key (PEM files): it then serves HTTPS."""

    certfile: str
    keyfile: str


def server_config(app: Any, host: str, port: int, log_level: str = "info",
                  header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, tls: TLSFiles | None = None) -> uvicorn.Config:
    """How every fleetllm server (worker, simulated worker, router) is served: no access log, 30 s to
    finish streams on shutdown, clients that are slow to send headers cut off (:mod:`.header_timeout`),
    HTTPS when ``tls`` names a certificate and its key."""
    # ws="none": no route speaks WebSocket, and loading uvicorn's WebSocket protocol costs a worker's cold start
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, ws="none",
                          timeout_graceful_shutdown=30, http=header_timeout_protocol(header_timeout_s),
                          ssl_certfile=tls.certfile if tls else None, ssl_keyfile=tls.keyfile if tls else None)


def make_server(app: Any, host: str, port: int, log_level: str = "info", on_exit: Callable[[], None] | None = None,
                drain: Callable[[], Awaitable[object]] | None = None,
                header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, tls: TLSFiles | None = None) -> _Server:
    """A uvicorn server for ``app``; ``server.run()`` serves until stopped (see the module's doc)."""
    return _Server(server_config(app, host, port, log_level, header_timeout_s, tls), on_exit, drain)


def run_app(app: Any, host: str, port: int, log_level: str = "info", on_exit: Callable[[], None] | None = None,
            drain: Callable[[], Awaitable[object]] | None = None,
            header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, tls: TLSFiles | None = None) -> None:
    make_server(app, host, port, log_level, on_exit, drain, header_timeout_s, tls).run()
