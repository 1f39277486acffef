"""What a refused adapter operation raises: the HTTP status it maps to and a message naming the problem."""

from __future__ import annotations


class LoraError(ValueError):
    """An adapter refused (400: it does not fit this model or these limits, or cannot be read) or unknown (404).

    The server answers ``status`` with ``message`` as an OpenAI-style error; nothing was loaded or changed.
    A ``ValueError``, so callers that already answer those with a 400 keep doing so."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def unknown_adapter(name: str) -> LoraError:
    """The 404 for a name that is neither the base model nor a loaded adapter."""
    return LoraError(f"the adapter `{name}` does not exist (not loaded)", status=404)
