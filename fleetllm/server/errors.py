"""The error every HTTP edge answers with: OpenAI-style ``{"error": {...}}`` and a status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}  # e.g. Retry-After on a 429 or 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}
