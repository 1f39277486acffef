"""The engine's blocks as a KV connector reaches them: the one door from outside into the block pool.

A connector edits the pool (reserves blocks for KV arriving from elsewhere, registers them in the prefix
cache, releases them) only through a :class:`BlockAccess`, and only on the engine thread, between steps:
:meth:`BlockAccess.call` runs a function there (through the async engine's command queue once it runs; at
once in a synchronous engine, whose caller is the engine thread). The names it exposes (``pool``, ``kv``,
``loaded``, ``model_name``, ``max_model_len``, ``scheduler``, :meth:`kv_blocks`) are the engine's own, so functions over it
(:mod:`fleetllm.disagg.kv_io`) also take an engine in tests. Torch-free.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from fleetllm.engine.engine import LLMEngine
    from fleetllm.engine.kv_memory import SharedKVFile

T = TypeVar("T")
Runner = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a thunk on the engine thread between steps


class BlockAccess:
    """One engine's pool, prefix cache, layout and KV tensors, for its connector."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.pool = engine.pool
        self.kv = engine.kv  # the prefix cache: extra key, cached prefixes
        self.scheduler = engine.scheduler  # its watermark: blocks kept free when importing
        self.loaded = engine.loaded  # the model's layout (layers, KV heads, head dim)
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len  # the most tokens one sequence holds here
        self.runner: Runner | None = None  # set by the async engine driving this one

    def kv_blocks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``[num_blocks, block_size, kv_heads, head_dim]`` views of the K and V cache."""
        return self._engine.kv_blocks()

    def kv_pool_file(self) -> SharedKVFile | None:
        """The shared-memory file the KV cache lives in (None: private memory, or no KV tensors)."""
        return self._engine.kv_pool_file()

    def prompt_pending(self, request_id: str) -> bool:
        """Whether request ``request_id`` is here with part of its prompt still to compute."""
        return self._engine.prompt_pending(request_id)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(self, *args)`` on the engine thread between steps; its result (or its error)."""
        return await self.run(fn, self, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine thread between steps (a connector's own state, which its sides read
        in the step); its result (or its error)."""
        if self.runner is None:  # a synchronous engine: the caller is its thread
            return fn(*args)
        return await self.runner(lambda: fn(*args))
