"""The fleet's own request id: minted by the router for every request it receives.

A client's ``x-request-id`` is the client's label (clients reuse and retry them), so it never keys
anything; this id does. It travels to the worker as ``x-fleetllm-request-id`` beside the client's
id and joins logs, traces and capture records across tiers. Sortable by time (a hex nanosecond
prefix) and unique (96 random bits after it).
"""

from __future__ import annotations

import secrets
import time

HEADER = "x-fleetllm-request-id"


def mint() -> str:
    """A new unique request id: 16 hex digits of wall-clock nanoseconds, then 24 random hex digits."""
    return f"{time.time_ns():016x}{secrets.token_hex(12)}"
