"""The router's own id for each request: unique, minted at arrival, sent to the worker as
``x-fleetllm-request-id`` (beside the client's ``x-request-id``), so every tier's records join on it."""

from __future__ import annotations

import uuid

HEADER = "x-fleetllm-request-id"


def mint() -> str:
    """A new request id (32 hex digits)."""
    return uuid.uuid4().hex
