"""The router's watch over an engine that is not a fleetllm worker: its model, its load from ``/metrics`` (or
llama.cpp's ``/slots``) every poll interval, and for vLLM workers with a KV-event source, their events."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx

from fleetllm.router.backends import BACKENDS
from fleetllm.router.backends.llamacpp import slots_load
from fleetllm.router.backends.vllm_events import VllmEventSubscriber, run_forever

if TYPE_CHECKING:
    from fleetllm.router.upstream import WorkerMonitor, WorkerState

log = logging.getLogger(__name__)
ROUTER_BLOCK_SIZE = 16  # the router-side index's granularity for engines that report no blocks


async def watch_engine(monitor: WorkerMonitor, w: WorkerState) -> None:
    """Poll ``w``'s load for as long as it is watched; subscribe to its KV events when it has a source."""
    backend = BACKENDS[w.kind or "openai"]
    w.block_size = w.block_size or ROUTER_BLOCK_SIZE
    sub_task = None
    if w.kv_source is not None:
        sub = VllmEventSubscriber(w.name, w.kv_source, monitor.index, on_event=lambda: _connected(w))
        monitor.subscribers[w.name] = sub
        sub_task = asyncio.create_task(run_forever(sub), name=f"vllm-events-{w.name}")
    else:
        w.reports_kv = False  # no events: the router's own record of what it routed stands in (long TTL)
    try:
        while not monitor.stopping:
            model, adapters = await _served_models(monitor.client, w.url)
            w.model = w.model or model
            if adapters is not None:  # vLLM lists its LoRA adapters with their parent; residency is its own
                w.adapters = w.resident_adapters = adapters
            load = await _load(monitor.client, w.url, backend.kind, monitor.health_timeout_s)
            if load:
                w.running = load.get("running", w.running)
                w.waiting = load.get("waiting", w.waiting)
                w.kv_usage = load.get("kv_usage", w.kv_usage)
            await asyncio.sleep(monitor.health_interval_s)
    finally:
        monitor.subscribers.pop(w.name, None)
        if sub_task is not None:
            sub_task.cancel()


def _connected(w: WorkerState) -> None:
    w.events_connected = True


async def _served_models(client: httpx.AsyncClient, url: str) -> tuple[str | None, frozenset[str] | None]:
    """The engine's model (the first entry without a ``parent``) and its LoRA adapters (the entries with one);
    (None, None) when ``/v1/models`` did not answer."""
    try:
        r = await client.get(url + "/v1/models", timeout=3.0)
        data = r.json().get("data", []) if r.status_code == 200 else None
        if data is None:
            return None, None
        models = [m["id"] for m in data if not m.get("parent")]
        return (models[0] if models else None), frozenset(m["id"] for m in data if m.get("parent"))
    except (httpx.HTTPError, ValueError, KeyError, AttributeError, TypeError):
        return None, None


async def _load(client: httpx.AsyncClient, url: str, kind: str, timeout: float) -> dict:
    backend = BACKENDS[kind]
    if not (backend.running or backend.waiting or backend.kv_usage):
        return {}
    try:
        r = await client.get(url + "/metrics", timeout=timeout)
        if r.status_code == 200:
            return backend.load(r.text)
        if kind == "llamacpp":  # /metrics is off unless llama-server runs with --metrics
            r = await client.get(url + "/slots", timeout=timeout)
            return slots_load(r.json()) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as e:
        log.debug("load of %s: %s", url, e)
    return {}
