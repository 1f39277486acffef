"""Several KV connectors as one: P/D and the KV tiers side by side on one engine.

Each hook goes to every connector in order; the step's metadata is each one's own. A request's outside
tokens come from the first connector that has any (one source per request), a step runs alone if any
connector asks, its blocks are cached only if all allow, and the step computes in the first placement
offered. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetllm.engine.kv_connector.base import KVConnector, KVConnectorMetadata, Layers, StepKV

if TYPE_CHECKING:
    import torch

    from fleetllm.engine.kv_connector.access import BlockAccess
    from fleetllm.engine.kv_connector.base import KVCaches
    from fleetllm.engine.scheduler import SchedulerOutput
    from fleetllm.engine.sequence import Sequence


@dataclass
class MultiMeta(KVConnectorMetadata):
    """Each connector's metadata for the step, in the connectors' order."""

    parts: list[KVConnectorMetadata] = field(default_factory=list)


class MultiConnector:
    """The connectors attached to one engine, driven as one."""

    def __init__(self, connectors: list[KVConnector]) -> None:
        self.connectors = list(connectors)
        self._source: dict[str, KVConnector] = {}  # request id -> the connector that loads its outside tokens
        self._active: list[tuple[KVConnector, KVConnectorMetadata]] = []  # this step's, with per-layer work

    def bind(self, blocks: BlockAccess) -> None:
        for c in self.connectors:
            c.bind(blocks)

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        for c in self.connectors:
            n = c.get_num_new_matched_tokens(seq, num_computed_tokens)
            if n > 0:
                self._source[seq.request_id] = c
                return n
        return 0

    def num_held_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        for c in self.connectors:  # as a match: the first connector holding any
            n = c.num_held_tokens(seq, num_computed_tokens)
            if n > 0:
                return n
        return 0

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        source = self._source.pop(seq.request_id, None)
        for c in self.connectors:
            c.update_state_after_alloc(seq, num_external_tokens if c is source else 0)

    def build_connector_meta(self, sched: SchedulerOutput) -> KVConnectorMetadata:
        parts = [c.build_connector_meta(sched) for c in self.connectors]
        return MultiMeta(per_layer=any(p.per_layer for p in parts), parts=parts)

    def request_finished(self, seq: Sequence) -> None:
        for c in self.connectors:
            c.request_finished(seq)

    def runs_alone(self, seq: Sequence) -> bool:
        return any(c.runs_alone(seq) for c in self.connectors)

    def caches_locally(self, seq: Sequence) -> bool:
        return all(c.caches_locally(seq) for c in self.connectors)

    def register_kv_caches(self, caches: KVCaches) -> None:
        for c in self.connectors:
            c.register_kv_caches(caches)

    def start_load_kv(self, meta: KVConnectorMetadata, kv_cache: Layers) -> StepKV | None:
        assert isinstance(meta, MultiMeta)
        placed, self._active = None, []
        for c, part in zip(self.connectors, meta.parts, strict=True):
            p = c.start_load_kv(part, kv_cache)
            placed = placed or p
            if part.per_layer:
                self._active.append((c, part))
        meta.per_layer = bool(self._active)
        return placed

    def wait_for_layer_load(self, layer: int) -> None:
        for c, _ in self._active:
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        for c, _ in self._active:
            c.save_kv_layer(layer, k_cache, v_cache)

    def wait_for_save(self) -> None:
        active, self._active = self._active, []
        for c, _ in active:
            c.wait_for_save()
