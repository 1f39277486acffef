"""Counting the requests a server is answering, so a draining server knows when it may exit.

An ASGI wrapper: a request counts from its first byte in to its last byte out (a stream counts until
it ends), so a count of 0 means no client waits on this process. Only the serving paths count:
endless streams (/kv/events) and probes would never let it reach 0.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class InFlight:
    """Wraps an ASGI app; ``count`` is the requests under ``prefixes`` being answered now."""

    def __init__(self, app: Any, prefixes: tuple[str, ...] = ("/v1/", "/pd/")) -> None:
        self.app = app
        self.prefixes = prefixes
        self.count = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight (True) or ``timeout_s`` passes (False)."""
        end = time.monotonic() + timeout_s
        while self.count:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.05)
        return True
