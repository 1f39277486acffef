"""How the router keys and feeds each non-fleetllm worker's prefix index: vLLM workers get their KV-event
source and vLLM's block hashes; engines without events keep the router-side index (fleetllm's hashes)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from fleetllm.router.backends import parse_worker
from fleetllm.router.backends.vllm_events import EventSource, source_from_config
from fleetllm.router.backends.vllm_hash import VllmHasher

if TYPE_CHECKING:
    from fleetllm.router.config import RouterConfig
    from fleetllm.router.upstream import WorkerState

log = logging.getLogger(__name__)


class EngineSetup:
    """The router's settings for other engines (``--kv-events-config``, ``--kv-events-endpoint``,
    ``--prefix-caching-hash-algo``, ``--hash-seed``, ``--engine-block-size``), applied to each worker."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.endpoints = {parse_worker(k)[1]: v for k, v in cfg.kv_events_endpoints.items()}
        seed = cfg.hash_seed if cfg.hash_seed is not None else os.environ.get("PYTHONHASHSEED")
        self.hasher = VllmHasher(cfg.prefix_caching_hash_algo, seed, cfg.engine_block_size) if seed else None
        self.hashers = {self.hasher.key: self.hasher} if self.hasher else {}

    def configure(self, w: WorkerState) -> None:
        """Give ``w`` its KV-event source and hash scheme when it publishes vLLM's events."""
        source = self._source(w)
        if source is None:
            return
        if self.hasher is None:
            log.warning("worker %s publishes KV events but no --hash-seed / PYTHONHASHSEED is known: vLLM's block "
                        "hashes cannot be reproduced, its events are ignored", w.name)
            return
        w.kv_source, w.hash_scheme, w.block_size = source, self.hasher.key, self.hasher.block_size

    def _source(self, w: WorkerState) -> EventSource | None:
        host = urlparse(w.url).hostname or "127.0.0.1"
        given = self.endpoints.get(w.url)
        if given is not None:
            if given.lstrip().startswith("{"):
                return source_from_config(json.loads(given), host)
            topic = json.loads(self.cfg.kv_events_config).get("topic", "") if self.cfg.kv_events_config else ""
            return EventSource(given, topic)
        if w.kind == "vllm" and self.cfg.kv_events_config:
            return source_from_config(self.cfg.kv_events_config, host)
        return None

    def hashes(self, token_ids: Sequence[int], schemes: set[str], lora_name: str | None = None) -> dict[str, list[int]]:
        """The prompt's block hashes under each scheme in ``schemes`` (a LoRA adapter's request: under its name)."""
        return {s: self.hashers[s].hashes(token_ids, lora_name) for s in schemes if s in self.hashers}
