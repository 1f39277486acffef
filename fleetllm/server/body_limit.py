"""A cap on request body size, for the worker and the router: larger bodies get a 413 before they are
read into memory.

An ASGI wrapper: a ``Content-Length`` over the cap is refused at once; a chunked body is counted as it
arrives and refused when it passes the cap (the app sees a disconnect and answers nothing more).
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # a 128k-token prompt as JSON is well under this


class BodyLimit:
    """Wraps an ASGI app; HTTP requests with a body over ``max_bytes`` get an OpenAI-style 413."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES, per_path: dict[str, int] | None = None) -> None:
        """``per_path``: other caps for some paths (a KV frame is no prompt: it may be far larger)."""
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.per_path.get(scope.get("path", ""), self.max_bytes)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            await self._refuse(send, cap)
            return
        seen = 0
        refused = False

        async def counted() -> dict[str, Any]:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap and not refused:
                    refused = True
                    await self._refuse(send, cap)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if not refused:  # the 413 went out already: nothing the app says after it reaches the client
                await send(message)

        await self.app(scope, counted, guarded_send)

    async def _refuse(self, send: Any, cap: int) -> None:
        body = json.dumps({"error": {"message": f"request body over {cap} bytes",
                                     "type": "invalid_request_error", "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
