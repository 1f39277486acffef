"""LoRA adapters at the router: which copies hold which adapters, an adapter's name resolved to its base model's
copies, and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` fanned out to them.

Where the router learns it (docs/lora.md, "Routing adapters"): a fleetllm worker's load report (its
``/kv/events`` stream, sent within 50 ms of a change) carries ``adapters`` (every adapter it serves) and
``resident_adapters`` (those in its step's tables: a request for one starts without a load); another engine's
``/v1/models`` (vLLM lists each adapter with its ``parent``), polled with its load, gives the first (its residency
is unknown: every listed adapter counts as resident). Adapters named in the router's config (``--adapters
NAME=BASE``, from a fleet YAML's ``adapters:``) resolve before any copy reports them.

The kv_aware cost model prices a copy that does not hold a request's adapter resident at
:attr:`~fleetllm.router.policies.CostModel.lora_load_s`: an adapter's requests stay on its holders until waiting
there costs more than a load elsewhere (that copy then loads it on demand and becomes a holder).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.server.adapters import LOAD_PATH, UNLOAD_PATH
from fleetllm.server.protocol import APIError, json_object

if TYPE_CHECKING:
    from fleetllm.router.gateway import Router
    from fleetllm.router.upstream import WorkerState

log = logging.getLogger(__name__)
ADMIN_PATHS = (LOAD_PATH, UNLOAD_PATH)  # the admin credential opens them (fleetllm/router/guard.py)


def adapter_bases(workers: list[WorkerState], configured: dict[str, str]) -> dict[str, str]:
    """Every adapter the fleet serves -> its base model: what the copies report, then the router's config."""
    bases = {a: w.model for w in workers if w.model for a in w.adapters}
    return {**bases, **configured}


def holds(w: WorkerState, lora_name: str | None) -> bool:
    """Whether ``w`` runs a request for ``lora_name`` without loading it first (always, for the base model)."""
    return lora_name is None or lora_name in w.resident_adapters


def serves(w: WorkerState, lora_name: str | None) -> bool:
    """Whether ``w`` takes a request for ``lora_name`` at all (registered there, resident or not; the base model:
    always): a prefill worker that does not would refuse it (404)."""
    return lora_name is None or lora_name in w.adapters


def adapter_routes(router: Router) -> list[Route]:
    """The router's two adapter endpoints: each call goes to every routable copy of the adapter's base model."""

    async def load(request: Request) -> Response:
        body = json_object(await request.body())
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "`lora_name` (a string) is required", "lora_name")
        base = _base(router, body, name)
        return await _fan_out(router, LOAD_PATH, body, _copies(router, base))

    async def unload(request: Request) -> Response:
        body = json_object(await request.body())
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "`lora_name` (a string) is required", "lora_name")
        base = adapter_bases(router.workers, router.cfg.adapters).get(name)
        if base is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found", "lora_name")
        copies = [w for w in _copies(router, base) if name in w.adapters]
        if not copies:
            raise APIError(404, f"The lora adapter '{name}' cannot be found on a routable copy", "lora_name")
        return await _fan_out(router, UNLOAD_PATH, {"lora_name": name}, copies)

    return [Route(LOAD_PATH, load, methods=["POST"]), Route(UNLOAD_PATH, unload, methods=["POST"])]


def _base(router: Router, body: dict[str, Any], name: str) -> str:
    """The base model a load names (``model``), or the fleet's one model; 400 / 404 otherwise."""
    served = {w.model for w in router.workers if w.model}
    model = body.get("model")
    if model is None:
        if len(served) != 1:
            raise APIError(400, f"give `model`: the base model to load adapter {name!r} onto (one of "
                                f"{', '.join(sorted(served)) or 'none yet'})", "model")
        return next(iter(served))
    if model not in served:
        raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(sorted(served))}", "model")
    return str(model)


def _copies(router: Router, base: str) -> list[WorkerState]:
    now = time.monotonic()
    copies = [w for w in router.workers if w.model == base and w.routable(now)]
    if not copies:
        raise APIError(503, f"no routable copy of {base!r} to reach; retry later", headers={"Retry-After": "1"})
    return copies


async def _fan_out(router: Router, path: str, body: dict[str, Any], copies: list[WorkerState]) -> Response:
    """``body`` to ``path`` on every copy; 200 when all took it, else the first refusal's status with every
    copy's answer (a refused adapter is refused by each copy alike, so that is what the client reads)."""
    assert router.client is not None
    client = router.client

    async def one(w: WorkerState) -> tuple[WorkerState, int, Any]:
        try:
            r = await client.post(w.url + path, json=body, timeout=router.cfg.request_timeout_s)
            try:
                return w, r.status_code, r.json()
            except ValueError:
                return w, r.status_code, {"error": {"message": r.text[:200]}}
        except httpx.HTTPError as e:
            return w, 502, {"error": {"message": f"{type(e).__name__}: {e}"}}

    answers = await asyncio.gather(*(one(w) for w in copies))
    per_copy = [{"worker": w.name, "status": status, **({"error": a.get("error")} if status != 200 else {})}
                for w, status, a in answers]
    bad = next(((status, a) for _, status, a in answers if status != 200), None)
    log.info("%s %s: %s", path, body.get("lora_name"), ", ".join(f"{c['worker']}={c['status']}" for c in per_copy))
    if bad is None:
        return JSONResponse({"status": "ok", "lora_name": body.get("lora_name"), "workers": per_copy})
    status, answer = bad
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else str(answer)
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                   "server_error", "param": "lora_path", "code": status}, "workers": per_copy},
                        status_code=status)
