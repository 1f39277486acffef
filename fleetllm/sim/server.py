"""Serve one or many simulated workers from one process (``fleetllm worker --simulate --count N``).

Each simulated worker is a full :class:`fleetllm.server.app.Worker` on its own port over its own
:func:`fleetllm.sim.engine.sim_engine`; they share the tokenizer and one event loop, so hundreds fit on one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Generator
from typing import Any

from fleetllm.lora.options import LoraServingOptions
from fleetllm.models.source import load_tokenizer
from fleetllm.server.app import ObservabilityConfig, Worker
from fleetllm.server.config import KVEventsOptions
from fleetllm.server.header_timeout import DEFAULT_HEADER_TIMEOUT_S
from fleetllm.server.uvicorn_runner import FrozenHeapServer, TLSFiles, server_config
from fleetllm.sim.engine import SimConfig, sim_engine
from fleetllm.sim.profile import TimingProfile
from fleetllm.store.config import StoreConfig


class _Server(FrozenHeapServer):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # signals are handled once for all servers in serve_simulated


def build_workers(model: str, count: int, cfg: SimConfig, profile: TimingProfile | None,
                  identities: list[dict[str, str]] | None = None, obs: ObservabilityConfig | None = None,
                  captures: Callable[[int, Any], Any] | None = None, store: StoreConfig | None = None,
                  kv_events: KVEventsOptions | None = None, api_key: str | None = None,
                  lora: LoraServingOptions | None = None) -> list[Worker]:
    """``api_key``: what clients must present (``--api-key``); ``captures(i, engine)``: worker ``i``'s capture (fleetllm/capture/), when capture is on; ``store``: where a
    store URI's config and tokenizer come from (its weights are never fetched); with ``kv_events``, worker ``i``
    publishes vLLM-format KV events on the endpoint's port + i; ``lora``: the LoRA adapters each serves (with
    ``cfg.enable_lora``)."""
    model_config, tokenizer = load_tokenizer(model, store)
    ids = identities or [None] * count
    engines = [sim_engine(cfg, tokenizer, model_config, profile, ids[i]) for i in range(count)]
    return [Worker(e, obs, capture=captures(i, e) if captures else None, kv_events=kv_events, kv_events_index=i,
                   api_key=api_key, lora=lora, store=store) for i, e in enumerate(engines)]


def serve_simulated(model: str, host: str, port: int, count: int, cfg: SimConfig, profile: TimingProfile | None,
                    log_level: str = "warning", identities: list[dict[str, str]] | None = None,
                    obs: ObservabilityConfig | None = None, captures: Callable[[int, Any], Any] | None = None,
                    drain_timeout_s: float = 30.0, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                    store: StoreConfig | None = None, kv_events: KVEventsOptions | None = None,
                    tls: TLSFiles | None = None, api_key: str | None = None,
                    lora: LoraServingOptions | None = None) -> bool:
    """Serve until SIGINT (stop now) or SIGTERM (drain every worker, then stop), or until an engine
    fails (then every worker stops); return whether one failed."""
    workers = build_workers(model, count, cfg, profile, identities, obs, captures, store, kv_events, api_key, lora)
    servers = [_Server(server_config(w.app, host, port + i, log_level, header_timeout_s, tls))
               for i, w in enumerate(workers)]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        draining: list[asyncio.Task[None]] = []

        def stop() -> None:
            for w in workers:
                w.closing = True
            for s in servers:
                s.should_exit = True

        async def drain_then_stop() -> None:
            await asyncio.gather(*(w.drain(drain_timeout_s) for w in workers))
            stop()

        def on_term() -> None:
            if draining:  # a second SIGTERM: stop now
                stop()
            else:
                draining.append(asyncio.ensure_future(drain_then_stop()))

        loop.add_signal_handler(signal.SIGINT, stop)
        loop.add_signal_handler(signal.SIGTERM, on_term)
        for w in workers:
            w.on_fatal = stop
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(main())
    return any(w.async_engine.failure is not None for w in workers)
