"""Engines the router fronts besides fleetllm's own workers: vLLM, SGLang, TGI, llama.cpp's ``llama-server``.

A worker is named ``KIND+http://host:port`` (``vllm+http://10.0.0.5:8000``) or plain ``http://host:port``; a
plain URL is a fleetllm worker when it serves ``/kv/events``, else its kind is found by probing
(:func:`detect`: ``/v1/models``' ``owned_by``, then the names on ``/metrics``, then ``/slots``). Each kind reads
its load from its own metric names (one module each here); vLLM's KV events come over ZMQ
(:mod:`~fleetllm.router.backends.vllm_events`), the others fall back to the router-side prefix index.
"""

from __future__ import annotations

import httpx

from fleetllm.router.backends import fleetllm, llamacpp, openai, sglang, tgi, vllm
from fleetllm.router.backends.base import Backend

BACKENDS: dict[str, Backend] = {m.BACKEND.kind: m.BACKEND for m in (fleetllm, vllm, sglang, tgi, llamacpp, openai)}
KINDS = tuple(BACKENDS)


def fleetllm_spec(url: str) -> str:
    """A fleet's own copy as the router is told of it: named a fleetllm worker, so that it is shown the
    fleet's secret from the first request (:mod:`fleetllm.router.worker_auth`)."""
    return "fleetllm+" + url


def parse_worker(spec: str) -> tuple[str | None, str]:
    """``KIND+http://host:port`` -> (kind, base URL); a plain URL (scheme optional) -> (None, URL)."""
    head, sep, rest = spec.partition("+")
    if sep and "://" in rest and "://" not in head:
        if head not in BACKENDS:
            raise ValueError(f"unknown engine kind {head!r} in worker {spec!r}; one of {', '.join(KINDS)}")
        return head, rest.rstrip("/")
    return None, (spec if "://" in spec else "http://" + spec).rstrip("/")


async def detect(client: httpx.AsyncClient, url: str, timeout: float = 3.0) -> str:
    """The kind of engine serving ``url`` ("openai" when nothing tells)."""
    try:
        r = await client.get(url + "/v1/models", timeout=timeout)
        owners = {m.get("owned_by") for m in r.json().get("data", [])} if r.status_code == 200 else set()
    except (httpx.HTTPError, ValueError, AttributeError):
        owners = set()
    for b in BACKENDS.values():
        if b.owned_by and b.owned_by in owners:
            return b.kind
    try:
        r = await client.get(url + "/metrics", timeout=timeout)
        text = r.text if r.status_code == 200 else ""
    except httpx.HTTPError:
        text = ""
    for b in BACKENDS.values():
        if b.metric_prefix and any(line.startswith(b.metric_prefix) for line in text.splitlines()):
            return b.kind
    try:
        r = await client.get(url + "/slots", timeout=timeout)
        if r.status_code == 200 and isinstance(r.json(), list):
            return "llamacpp"
    except (httpx.HTTPError, ValueError):
        pass
    return "openai"
