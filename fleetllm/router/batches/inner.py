"""A batch line as a request to the router's own completion handler, and its answer read back.

The line travels the path every client request travels (the key's model and limits, priority, routing,
retries, capture); its owner rides in the scope, as the key a client would have presented, since a batch
keeps its key's id, never the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

OWNER_SCOPE = "fleetllm.batch_owner"  # the key id a batch line runs as ("" with keys off)


def default_dir() -> Path:
    """Where a router keeps its batches unless told: under the user's state directory."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "fleetllm" / "batches"


def inner_request(path: str, body: dict[str, Any], owner: str) -> Request:
    """A POST of ``body`` to ``path`` on behalf of ``owner``, as the router's handlers read one."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "scheme": "http", "http_version": "1.1", "client": None, "server": None,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             OWNER_SCOPE: owner}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


async def read_answer(response: Response, request_id_header: str) -> tuple[int, Any, str]:
    """(status, body as JSON, the router's request id) of a handler's response."""
    iterator = getattr(response, "body_iterator", None)
    if iterator is not None:
        content = b"".join([c if isinstance(c, bytes) else c.encode() async for c in iterator])
    else:
        content = bytes(response.body)
    try:
        body = json.loads(content)
    except ValueError:
        body = content.decode(errors="replace")
    return response.status_code, body, response.headers.get(request_id_header, "")
