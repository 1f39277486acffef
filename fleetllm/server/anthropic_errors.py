"""Errors of the Messages API in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

The anthropic client maps statuses to exception classes either way, but agent CLIs read
``error.type`` and ``error.message`` from Anthropic's body. Shared by the worker (its ``/v1/messages``
handler) and the router (the errors it answers itself on that path); torch-free, like the router.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse, Response

from fleetllm.server.protocol import APIError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for ``status`` (5xx other than overload are ``api_error``)."""
    kind = TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message), status_code=e.status, headers=e.headers)


def reshape(response: Response) -> Response:
    """An error answer with an OpenAI error body, reshaped for a Messages client (others unchanged)."""
    body = getattr(response, "body", None)
    if response.status_code < 400 or not body:
        return response
    try:
        obj = json.loads(body)
    except ValueError:
        return response
    err = obj.get("error") if isinstance(obj, dict) else None
    if obj.get("type") == "error" or not isinstance(err, dict):
        return response
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(error_body(response.status_code, str(err.get("message", ""))),
                        status_code=response.status_code, headers=headers)
