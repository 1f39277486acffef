"""A model's hub token: read from the file or environment variable its config names, and hard to leak.

The value lives in a :class:`Secret` whose ``str``/``repr`` are a mask, so a token that slips into an
f-string, a log call or an exception prints as ``***``; only :meth:`Secret.reveal` gives it, at the one
place it is handed to the hub client.
"""

from __future__ import annotations

import os
from pathlib import Path

from fleetllm.store.config import StoreConfig
from fleetllm.store.errors import StoreError

MASK = "***"


class Secret:
    """A string that does not print."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __str__(self) -> str:
        return MASK

    __repr__ = __str__

    def __reduce__(self) -> None:  # never pickled into another process or a cache file
        raise TypeError("a Secret is not serialisable")


def load_token(cfg: StoreConfig, model: str) -> Secret | None:
    """The token of ``model`` from ``cfg.token_file`` or ``cfg.token_env``; None when neither is set.

    A named source that is missing or empty is an error naming the model and the source, never the value.
    """
    if cfg.token_file:
        try:
            value = Path(cfg.token_file).expanduser().read_text().strip()
        except OSError as e:
            raise StoreError(f"model {model}: cannot read its token file {cfg.token_file} ({e.strerror})", 401) from None
        if not value:
            raise StoreError(f"model {model}: its token file {cfg.token_file} is empty", 401)
        return Secret(value)
    if cfg.token_env:
        value = os.environ.get(cfg.token_env, "").strip()
        if not value:
            raise StoreError(f"model {model}: the environment variable {cfg.token_env} named as its token is unset", 401)
        return Secret(value)
    return None
