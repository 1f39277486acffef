"""The router's admin endpoints: the fleet controller's hands on membership, and the usage report.

``POST /admin/workers`` ``{url, zone, role, model}`` adds a worker (routable once its health check
passes); ``POST /admin/workers/drain`` ``{url}`` stops new requests to it (in-flight ones finish);
``POST /admin/workers/remove`` ``{url}`` forgets it; ``POST /admin/autoscaler`` records a decision
(exported as ``fleetllm_autoscaler_*``); ``POST /admin/traffic`` ``{model, weights: {variant: weight}}``
shifts a split model's traffic (promote or roll back a canary); ``GET /admin/usage`` is the per-key usage. All need
the admin token or an admin key, checked before the body is read (:mod:`fleetllm.router.guard`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.router.auth import Usage
from fleetllm.server.limits import number
from fleetllm.server.protocol import APIError, json_object

if TYPE_CHECKING:
    from fleetllm.router.gateway import Router

log = logging.getLogger(__name__)
MAX_COPIES = 10_000  # the most copies of a model an autoscaler decision may name


def admin_routes(router: Router) -> list[Route]:
    async def body(request: Request) -> dict[str, Any]:
        d = json_object(await request.body())
        if request.url.path.startswith("/admin/workers") and not isinstance(d.get("url"), str):
            raise APIError(400, "`url` (a worker's base URL) is required", "url")
        return d

    async def add(request: Request) -> Response:
        d = await body(request)
        w = router.add_worker(d["url"], str(d.get("zone") or ""), str(d.get("role") or "both"), d.get("model"),
                              str(d.get("variant") or ""))
        log.info("worker %s added (model %s)", w.name, w.model)
        return JSONResponse({"name": w.name, "url": w.url}, status_code=201)

    async def drain(request: Request) -> Response:
        w = router.worker((await body(request))["url"])
        w.draining = True
        log.info("worker %s draining (%d in flight)", w.name, w.inflight)
        return JSONResponse({"name": w.name, "inflight": w.inflight})

    async def remove(request: Request) -> Response:
        url = (await body(request))["url"]
        await router.remove_worker(url)
        log.info("worker %s removed", url)
        return JSONResponse({"removed": url})

    async def autoscaler(request: Request) -> Response:
        d = await body(request)
        model, m = str(d.get("model")), router.metrics
        m.desired.labels(model=model).set(number(d.get("desired"), "desired", 0, MAX_COPIES, 0))
        m.scale_decisions.labels(model=model, direction=str(d.get("direction")), reason=str(d.get("reason"))).inc()
        return JSONResponse({"ok": True})

    async def traffic(request: Request) -> Response:
        d = await body(request)
        model, weights = d.get("model"), d.get("weights")
        if model not in router.served_models():
            raise APIError(404, f"no served model {model!r}", "model")
        if not isinstance(weights, dict):
            raise APIError(400, "`weights` ({variant: weight}) is required", "weights")
        try:
            router.traffic.set(model, weights)
        except ValueError as e:
            raise APIError(400, str(e), "weights") from None
        log.info("traffic split of %s set to %s", model, weights)
        return JSONResponse({"model": model, "weights": router.traffic.splits[model]})

    async def usage(request: Request) -> Response:
        gate = router.gate
        if gate is None:
            return JSONResponse({"keys": []})
        keys = [{**rec.public(), **asdict(gate.usage.get(rec.id, Usage()))} for rec in gate.store.records()]
        return JSONResponse({"keys": keys})

    return [Route("/admin/workers", add, methods=["POST"]), Route("/admin/workers/drain", drain, methods=["POST"]),
            Route("/admin/workers/remove", remove, methods=["POST"]),
            Route("/admin/autoscaler", autoscaler, methods=["POST"]), Route("/admin/traffic", traffic, methods=["POST"]),
            Route("/admin/usage", usage, methods=["GET"])]
