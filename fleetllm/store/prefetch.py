"""Fetch a worker's model while the worker still imports PyTorch.

A new worker spends seconds importing torch, the server and the engine before it asks for its model; the
store's part (resolve: one request to the source; verify: SHA-256 of every cached file, which releases the
GIL) does not need any of it. ``start`` runs the fetch on a thread from the first lines of ``fleetllm worker``;
the loader then ``take``s the result (or the ``StoreError``, raised in the loader's thread as if it had
fetched itself). Stdlib only until the thread runs: importing this module costs nothing.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from fleetllm.store.uri import is_remote

if TYPE_CHECKING:
    from fleetllm.store.config import StoreConfig
    from fleetllm.store.store import Fetched

_pending: list[tuple[str, StoreConfig | None, Future[Fetched]]] = []
_lock = threading.Lock()


def start(ref: str, cfg: StoreConfig | None) -> None:
    """Begin fetching ``ref`` (a store URI; anything else is ignored) into ``cfg``'s cache on a daemon thread."""
    if not is_remote(ref):
        return
    future: Future[Fetched] = Future()

    def run() -> None:
        from fleetllm.store.store import ModelStore

        try:
            future.set_result(ModelStore(cfg).fetch(ref))
        except BaseException as e:  # noqa: BLE001 - handed to whoever takes the result, and raised there
            future.set_exception(e)

    with _lock:
        _pending.append((ref, cfg, future))
    threading.Thread(target=run, name="model-prefetch", daemon=True).start()


def take(ref: str, cfg: StoreConfig | None) -> Fetched | None:
    """The result of a ``start`` for the same reference and settings (waiting for it), else None."""
    with _lock:
        match = next((p for p in _pending if p[0] == ref and p[1] == cfg), None)
        if match is None:
            return None
        _pending.remove(match)
    return match[2].result()
