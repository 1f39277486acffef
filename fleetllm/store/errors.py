"""Errors of the store that a user can act on: they name the model and never hold a token."""

from __future__ import annotations


class StoreError(Exception):
    """A model could not be fetched: ``status`` as an HTTP status (401/403 access, 404 not found,
    502 source failed, 503 source unreachable without a cached copy)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class SourceUnreachable(Exception):
    """The source did not answer (connection refused, timeout, 5xx): the cache may serve instead."""
