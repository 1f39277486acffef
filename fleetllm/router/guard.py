"""The router's door: every request's credential checked from its headers before a byte of its body is read.

Which credential a path needs (:class:`~fleetllm.router.gateway.Router` decides what each one grants):

- ``/admin/*``, ``/router/state`` and the LoRA adapter loads (``/v1/load_lora_adapter``,
  ``/v1/unload_lora_adapter``): an admin credential (the admin token, or an ``admin`` API key);
  401 without one, 403 for a credential that is valid but no admin one (a client key, the workers' secret);
- ``/metrics``: open without API keys (as a vLLM server's); with keys, an admin credential or the workers'
  secret (what Prometheus presents to workers too);
- ``/v1/*``, ``/tokenize``, ``/detokenize``: a live API key when the router has a keys file (the rest of
  the key's checks, model and limits, need the body and come after);
- ``/health`` and the rest: open.

Admin bodies are small: ``ADMIN_BODY_BYTES`` caps them (413), as the body limit caps the others; a batch file's
upload (``/v1/files``) is capped by ``--batch-max-file-mb`` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetllm.server.body_limit import BodyLimit
from fleetllm.server.protocol import APIError
from fleetllm.server.worker_secret import send_error

if TYPE_CHECKING:
    from fleetllm.router.gateway import Router

ADMIN_PREFIX = "/admin/"
ADMIN_PATHS = ("/router/state", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # LoRA: fleetllm/router/adapters.py
KEYED_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*
ADMIN_BODY_BYTES = 64 * 2**10
FORM_SLACK_BYTES = 2**20  # a multipart form's own bytes around the file it carries


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIX) or path in ADMIN_PATHS


def guarded(app: Any, router: Router, max_body_bytes: int) -> RouterGuard:
    """The router's Starlette ``app`` behind its door: credentials checked first, then each body capped
    (admin routes at ``ADMIN_BODY_BYTES``, the rest at ``max_body_bytes``) before it is read."""
    admin = [r.path for r in app.routes if is_admin_path(r.path)]
    # a batch file's upload: its own cap (a file over it is a 400 once read; a body far over it, a 413 unread)
    upload = {"/v1/files": router.batches.limits.max_file_bytes + FORM_SLACK_BYTES}
    return RouterGuard(BodyLimit(app, max_body_bytes, dict.fromkeys(admin, ADMIN_BODY_BYTES) | upload), router)


class RouterGuard:
    """ASGI middleware over the router's app: refuses a request whose path needs a credential it lacks."""

    def __init__(self, app: Any, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            try:
                self.check(scope["path"], _authorization(scope["headers"]))
            except APIError as e:
                await send_error(send, e.status, e.message, e.body()["error"]["type"])
                return
        await self.app(scope, receive, send)

    def check(self, path: str, authorization: str | None) -> None:
        """Raise the 401 / 403 ``APIError`` a request to ``path`` with this ``Authorization`` header gets."""
        r = self.router
        if is_admin_path(path):
            r.require_admin(authorization)
        elif path == "/metrics":
            r.require_reader(authorization)
        elif path.startswith("/v1/") or path in KEYED_PATHS:
            r.require_key(authorization)


def _authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            return value.decode("latin-1")
    return None
