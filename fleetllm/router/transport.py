"""The router's HTTP transport: one connection pool per upstream worker.

A router in front of 32 workers keeps hundreds of connections open (streams, health checks, KV event
streams, metrics scrapes). httpcore's pool scans every connection it holds each time it hands one out or
takes one back, so with one shared pool the router's CPU per request grows with the fleet: a profile of a
router at 6 users per worker on 32 workers spent about a fifth of its samples in that scan. Each worker's
connections in a pool of their own keep every scan as short as that worker's share.
"""

from __future__ import annotations

import ssl

import httpx


class PerHostTransport(httpx.AsyncBaseTransport):
    """Delegates each request to an ``httpx.AsyncHTTPTransport`` of its own (scheme, host, port), made on first
    use; every one is closed with this transport."""

    def __init__(self, verify: ssl.SSLContext | bool = True, keepalive_per_host: int = 64) -> None:
        self._verify = verify
        self._limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive_per_host)
        self._pools: dict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = (request.url.raw_scheme, request.url.raw_host, request.url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = httpx.AsyncHTTPTransport(verify=self._verify, limits=self._limits)
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()
