"""Workers that take traffic only from their router: a shared secret on every request but the probes.

With API keys on, a client could bypass them by calling a worker directly. ``fleetllm serve`` gives the
router and its workers one random secret (``FLEETLLM_WORKER_SECRET`` in their environment, never on a
command line where ``ps`` would show it); the router sends it as ``Authorization: Bearer <secret>`` and a
worker answers anything else with 401. ``/health`` and ``/ready`` stay open: probes carry no secrets.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

ENV = "FLEETLLM_WORKER_SECRET"
OPEN_PATHS = ("/health", "/ready")


def worker_secret() -> str | None:
    """The secret this process shares with its router/workers, if the fleet set one."""
    return os.environ.get(ENV) or None


class RequireSecret:
    """ASGI middleware: 401 for any HTTP request without the secret (compared in constant time)."""

    def __init__(self, app: Any, secret: str) -> None:
        self.app = app
        self.expected = f"Bearer {secret}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(auth, self.expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "this worker takes requests from its router only",
                                     "type": "authentication_error", "param": None, "code": 401}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
