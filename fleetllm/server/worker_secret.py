"""Workers that take traffic only from their fleet: a shared secret on every request but the probes.

``fleetllm serve`` gives the router and its workers one random secret per fleet (``FLEETLLM_WORKER_SECRET``
in their environment, never on a command line where ``ps`` would show it; or ``FLEETLLM_WORKER_SECRET_FILE``
naming a file, as Kubernetes mounts a Secret). The router presents it as ``Authorization: Bearer <secret>``
to its fleetllm workers, and prefill workers to decode workers; a worker answers anything else with 401
before it reads a byte of the body. ``/health`` and ``/ready`` stay open (probes carry no credentials) and
say nothing but a status word.

A worker started by hand with no secret serves unauthenticated, as vLLM does without ``--api-key``; given
``--api-key`` its client API needs that key. The ``/pd/*`` endpoints (a peer's KV and control messages)
take only the fleet's secret: a client key never opens them, and a worker with a key but no secret serves
no disaggregation at all. LoRA adapters' loads and unloads (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)
take the fleet's secret when the worker has one, else its ``--api-key`` (as vLLM's), else anyone's.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from pathlib import Path
from typing import Any

ENV = "FLEETLLM_WORKER_SECRET"
FILE_ENV = "FLEETLLM_WORKER_SECRET_FILE"
OPEN_PATHS = ("/health", "/ready")
PEER_PREFIX = "/pd/"  # worker-to-worker endpoints: the fleet's secret only
# what changes the worker's state for every client (LoRA adapters' loads): the fleet's secret when it has one (only
# its router, holding the admin credential, sends them), else the client key as vLLM's --api-key guards them
CONTROL_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# on every 401 of a fleet's worker: a router meeting a plain URL learns it is a fleetllm worker (to be shown the
# fleet's secret) without showing the secret to whatever else might listen there
CHALLENGE = (b"www-authenticate", b'Bearer realm="fleetllm-worker"')


def worker_secret() -> str | None:
    """The secret this process shares with its fleet: from the environment, or the file it names; None if
    the fleet set none (a file named but unreadable is an error: serving open instead would be silent)."""
    value = os.environ.get(ENV)
    if value:
        return value
    path = os.environ.get(FILE_ENV)
    if path:
        return Path(path).read_text(encoding="utf-8").strip() or None
    return None


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The credential of an ASGI request's ``Authorization: Bearer`` header (b"" when there is none)."""
    for name, value in headers:
        if name == b"authorization":
            return value[7:].strip() if value[:7].lower() == b"bearer " else b""
    return b""


def matches(given: bytes, expected: bytes | None) -> bool:
    """Constant-time equality of a presented credential with an expected one (never equal to None)."""
    return expected is not None and hmac.compare_digest(given, expected)


class RequireSecret:
    """ASGI middleware: 401 for any HTTP request without a credential it accepts, checked before the app
    runs (so before any body is read): the fleet's ``secret`` anywhere, a client ``api_key`` anywhere but
    ``/pd/*``."""

    def __init__(self, app: Any, secret: str | None, api_key: str | None = None) -> None:
        self.app = app
        self.secret = secret.encode() if secret else None
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = bearer(scope["headers"])
        secret_only = path.startswith(PEER_PREFIX) or (path in CONTROL_PATHS and self.secret is not None)
        if matches(given, self.secret) or (not secret_only and matches(given, self.api_key)):
            await self.app(scope, receive, send)
            return
        why = ("this worker takes requests from its fleet only" if secret_only or not self.api_key
               else "a valid API key is required: send `Authorization: Bearer <key>`")
        await send_error(send, 401, why, "authentication_error", [CHALLENGE] if self.secret else [])


async def send_error(send: Any, status: int, message: str, kind: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An OpenAI-style JSON error straight onto an ASGI ``send`` (middleware answering before the app)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def warn_if_open(host: str, secret: str | None, api_key: str | None) -> bool:
    """Log a warning when a worker with no credential listens beyond loopback (anyone who reaches it may use
    it, its ``/pd/*`` endpoints included); whether it warned."""
    if secret or api_key or _loopback(host):
        return False
    logging.getLogger("fleetllm").warning(
        "this worker listens on %s with no credential: anyone who reaches it may use it (give --api-key, or "
        "run it in a fleet, whose workers share a secret)", host)
    return True


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
