"""Run an ASGI app with uvicorn, telling the app when shutdown starts.

Endless streams (a worker's /kv/events, a router's upstream subscriptions) must end when the server
is asked to stop, or uvicorn would wait for them forever; ``on_exit`` runs at the first SIGINT/SIGTERM.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn


def run_app(app: Any, host: str, port: int, log_level: str = "info", on_exit: Callable[[], None] | None = None) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    if on_exit is not None:
        original = server.handle_exit

        def handle_exit(sig: int, frame: FrameType | None) -> None:
            on_exit()
            original(sig, frame)

        server.handle_exit = handle_exit  # type: ignore[method-assign]
    server.run()
