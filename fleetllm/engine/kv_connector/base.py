"""The KV connector interface: how KV that lives outside the engine's pool enters and leaves it.

Modelled on vLLM v1's ``KVConnectorBase_V1``. A connector has two sides, both driven by the engine:

- **scheduler side** (engine thread, while a step is planned and after it): how many of a request's tokens
  can be loaded from outside (:meth:`KVConnectorScheduler.get_num_new_matched_tokens`), what was allocated
  for them (:meth:`~KVConnectorScheduler.update_state_after_alloc`), what the worker side does this step
  (:meth:`~KVConnectorScheduler.build_connector_meta`, carried by the scheduler's output as
  ``kv_connector_metadata``), and what happens when a request finishes
  (:meth:`~KVConnectorScheduler.request_finished`). Two questions shape the step itself: whether a request's
  step must run alone (its KV is computed in another pool this step: the step's KV goes there), and whether
  its blocks here may enter the prefix cache (not when they do not hold what it computed).
- **worker side** (the model runner, inside the step): start loading (and choose where this step's KV is
  computed: :class:`StepKV`), wait for a layer before it runs, save a layer once attention wrote it, wait for
  the saves at the end of the forward.

The engine knows no connector by name: :class:`KVConnectorBase` does nothing, and one connector
(:mod:`fleetllm.disagg.connector`: prefill/decode over a shared pool, shared-memory frames or HTTP) is
attached with :meth:`fleetllm.engine.engine.LLMEngine.set_kv_connector`. Torch-free, like the engine core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from fleetllm.engine.kv_connector.access import BlockAccess
    from fleetllm.engine.kv_memory import SharedKVFile
    from fleetllm.engine.scheduler import SchedulerOutput
    from fleetllm.engine.sequence import Sequence

Layers = list[tuple["torch.Tensor", "torch.Tensor"]]


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side about one step (a connector subclasses it).

    ``per_layer``: the worker side acts at each layer this step (loads waited for, saves made), so the model
    runs layer by layer rather than through a fused stack that would skip the hooks."""

    per_layer: bool = False


@dataclass
class KVCaches:
    """The KV cache an executor holds, as a connector reaches it."""

    layers: Layers  # per layer, ``[num_blocks, block_size, kv_heads, head_dim]`` views of K and V
    pool_file: SharedKVFile | None = None  # the shared-memory file they live in (None: private memory)


@dataclass
class StepKV:
    """Where one step computes its KV when a connector places it outside this engine's pool (the step then
    holds that one request): the other pool's flat K and V per layer, and the request's blocks there."""

    kv_cache: Layers
    block_table: list[int] = field(default_factory=list)


class KVConnectorScheduler(Protocol):
    """The scheduler side: engine thread only."""

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens of ``seq`` beyond its ``num_computed_tokens`` local hits that can be loaded from outside."""
        ...

    def num_held_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens of ``seq`` beyond ``num_computed_tokens`` the connector would load as far as it knows now, read
        from nothing and changing nothing (an estimate of the queue's work, asked as a request arrives)."""
        ...

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """``seq`` was admitted with blocks for its prompt; ``num_external_tokens`` of them are to be loaded (already
        counted in ``seq.num_computed_tokens``; a connector that cannot load them lowers it back by as many,
        and the scheduler computes them instead)."""
        ...

    def build_connector_meta(self, sched: SchedulerOutput) -> KVConnectorMetadata:
        """What the worker side does in the step ``sched`` (called once per step, after scheduling)."""
        ...

    def request_finished(self, seq: Sequence) -> None:
        """``seq`` finished (any way; its blocks are freed): drop what is kept for it."""
        ...

    def runs_alone(self, seq: Sequence) -> bool:
        """Whether ``seq``'s steps must hold no other request (its KV is computed outside this pool)."""
        ...

    def caches_locally(self, seq: Sequence) -> bool:
        """Whether ``seq``'s full blocks here may enter the prefix cache (False: they do not hold its KV)."""
        ...


class KVConnectorWorker(Protocol):
    """The worker side: inside the step, on the thread that runs the model."""

    def register_kv_caches(self, caches: KVCaches) -> None:
        """The executor's KV cache (once, when the connector is attached)."""
        ...

    def start_load_kv(self, meta: KVConnectorMetadata, kv_cache: Layers) -> StepKV | None:
        """Before the forward: start what the step loads; where it computes (None: ``kv_cache``, this pool's).
        Raising fails the step's requests, never the engine."""
        ...

    def wait_for_layer_load(self, layer: int) -> None:
        """Before layer ``layer`` runs (with ``per_layer``): its KV is in place, and may still be written."""
        ...

    def save_kv_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """After layer ``layer``'s attention wrote its K and V (flat ``[slots, kv_heads, head_dim]``)."""
        ...

    def wait_for_save(self) -> None:
        """After the forward: every save of the step is handed off (the step's state may be dropped)."""
        ...


class KVConnector(KVConnectorScheduler, KVConnectorWorker, Protocol):
    """Both sides, and the engine's blocks given to it when attached."""

    def bind(self, blocks: BlockAccess) -> None:
        """Attached to an engine: its blocks (scheduler side), reached only through ``blocks``."""
        ...


class KVConnectorBase:
    """A connector that moves nothing: every hook a no-op. Connectors subclass it and override what they use."""

    blocks: BlockAccess | None = None
    caches: KVCaches | None = None

    def bind(self, blocks: BlockAccess) -> None:
        self.blocks = blocks

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        return 0

    def num_held_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, sched: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, seq: Sequence) -> None:
        return None

    def runs_alone(self, seq: Sequence) -> bool:
        return False

    def caches_locally(self, seq: Sequence) -> bool:
        return True

    def register_kv_caches(self, caches: KVCaches) -> None:
        self.caches = caches

    def start_load_kv(self, meta: KVConnectorMetadata, kv_cache: Layers) -> StepKV | None:
        return None

    def wait_for_layer_load(self, layer: int) -> None:
        return None

    def save_kv_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

