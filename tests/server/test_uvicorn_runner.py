"""How every fleetllm server is served (:mod:`fleetllm.server.uvicorn_runner`): the heap alive when a server
starts serving is out of the garbage collector's view, so no full collection walks it with the event loop
stopped while requests are in flight."""

from __future__ import annotations

import gc
import threading
import time

import httpx
from fleet_helpers import free_port
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from fleetllm.server.uvicorn_runner import make_server


def test_a_server_freezes_the_heap_it_starts_with() -> None:
    app = Starlette(routes=[Route("/health", lambda _: PlainTextResponse("ok"))])
    port = free_port()
    server = make_server(app, "127.0.0.1", port, "warning")
    gc.unfreeze()  # whatever an earlier test's server froze
    assert gc.get_freeze_count() == 0
    built = [object()]  # tracked by the collector until the server starts
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < end
            time.sleep(0.02)
        assert httpx.get(f"http://127.0.0.1:{port}/health").text == "ok"
        assert gc.get_freeze_count() > 0
        assert not any(o is built for o in gc.get_objects())  # frozen objects are past every generation
    finally:
        server.exit_now()
        thread.join(30)
