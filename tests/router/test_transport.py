"""The router's transport keeps each upstream's connections in a pool of their own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from fleetllm.router.transport import PerHostTransport


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: connections stay in their pool

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = self.server.server_address[1].to_bytes(4, "big")
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def two_servers() -> Iterator[list[str]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Hello) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_each_upstream_gets_its_own_pool_and_closing_closes_them_all(two_servers: list[str]) -> None:
    async def go() -> tuple[list[int], list[set[int]], int]:
        transport = PerHostTransport()
        async with httpx.AsyncClient(transport=transport) as client:
            answers = await asyncio.gather(*(client.get(u) for u in two_servers * 4))
            ports = [int.from_bytes(r.content, "big") for r in answers]
            pools = [{c._origin.port for c in pool._pool.connections} for pool in transport._pools.values()]
        return ports, pools, len(transport._pools)

    ports, pools, left = asyncio.run(go())
    expected = [httpx.URL(u).port for u in two_servers]
    assert ports == expected * 4  # each request reached the server it named
    assert sorted(pools, key=min) == sorted(({p} for p in expected), key=min)  # one pool per upstream
    assert left == 0  # the client's close closed every pool
