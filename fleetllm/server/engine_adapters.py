"""The one place the server asks the engine about LoRA adapters (:class:`~fleetllm.server.adapters.AdapterBackend`).

Loads and unloads go through the async engine (the adapter is read and checked on a thread, registered between
steps); names and residency are read from the event loop without a lock (a slightly stale view is fine for
``/v1/models`` and the load report, as the worker's other load figures are). A simulated worker's engine has the
same registry, keeping the bookkeeping only (no tables), so both kinds of worker answer alike.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from fleetllm.engine.async_engine import AsyncEngine

T = TypeVar("T")


class EngineAdapters:
    """An engine's adapter registry (``engine.lora``, set with ``--enable-lora``) as the server's backend."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine

    def names(self) -> list[str]:
        return settled(self.engine.lora_names)

    def resident(self) -> list[str]:
        lora = self.engine.lora
        return [] if lora is None else settled(lambda: list(lora.resident()))

    async def load(self, name: str, path: Path) -> None:
        await self.async_engine.load_lora(name, str(path))

    def load_now(self, name: str, path: Path) -> None:
        self.engine.load_lora(name, str(path))  # the engine thread is not running yet: no step to race

    async def unload(self, name: str) -> None:
        await self.async_engine.unload_lora(name)


def settled(read: Callable[[], T]) -> T:
    """``read()`` of the engine thread's containers from another thread, again if the engine thread changed the one
    it iterates meanwhile (a load between two steps, a request admitted)."""
    for _ in range(3):
        try:
            return read()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return read()
