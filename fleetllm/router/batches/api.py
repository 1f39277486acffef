"""The Batch API's HTTP routes, thin: who asks (the owner), the checks, the store and the runner.

Each file and batch belongs to the key that made it (with keys off, to everyone: one tenant) and is a 404 to
any other. These calls are management: they count toward no key's ``rpm_limit`` (the batch's lines do, as
that key's requests, when they run). Files and finished batches are kept ``retention_h`` hours.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetllm.router.batches.form import parse_form
from fleetllm.router.batches.lines import ENDPOINTS, parse_lines
from fleetllm.router.batches.runner import ACTIVE, BatchRunner
from fleetllm.router.batches.store import OWNER, BatchStore, new_id
from fleetllm.server.protocol import APIError, json_object

PRIVATE = (OWNER, "retain_until", "created")  # kept beside an object, never shown (created: the list's order)
WINDOW = re.compile(r"^([1-9][0-9]*)([smh])$")
UNITS = {"s": 1, "m": 60, "h": 3600}


@dataclass
class BatchLimits:
    max_file_bytes: int
    max_active: int  # batches per owner not yet ended
    retention_h: float


class BatchAPI:
    """``/v1/files`` and ``/v1/batches``; ``owner_of`` names a request's owner (a key id, "" with keys off)."""

    def __init__(self, store: BatchStore, runner: BatchRunner, limits: BatchLimits,
                 owner_of: Callable[[Request], str]) -> None:
        self.store, self.runner, self.limits, self.owner_of = store, runner, limits, owner_of

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files/{id}", self.file, methods=["GET"]),
            Route("/v1/files/{id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{id}/content", self.content, methods=["GET"]),
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.list, methods=["GET"]),
            Route("/v1/batches/{id}", self.batch, methods=["GET"]),
            Route("/v1/batches/{id}/cancel", self.cancel, methods=["POST"]),
        ]

    def start(self) -> None:
        self.sweep()
        self.runner.start()

    # ---- files ------------------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        owner = self.owner_of(request)
        form = await asyncio.to_thread(parse_form, await request.body(), request.headers.get("content-type", ""))
        purpose = form.get("purpose", (None, b""))[1].decode(errors="replace")
        if purpose != "batch":
            raise APIError(400, f"purpose `{purpose}` is not served here: only `batch`", "purpose")
        if "file" not in form:
            raise APIError(400, "the form has no `file` part", "file")
        filename, data = form["file"]
        if len(data) > self.limits.max_file_bytes:
            raise APIError(400, f"the file is over the {self.limits.max_file_bytes} bytes a batch file may hold", "file")
        lines = await asyncio.to_thread(parse_lines, data)
        if not any(line.error is None for line in lines):
            raise APIError(400, "no line of the file is a request (custom_id, method POST, url, body)", "file")
        self.sweep()
        now = int(time.time())
        meta = {"id": new_id("file"), "object": "file", "bytes": len(data), "created_at": now,
                "filename": filename or "batch.jsonl", "purpose": "batch", "status": "processed",
                "expires_at": self._retain_until(now), OWNER: owner}
        await asyncio.to_thread(self.store.put_file, meta, data)
        return JSONResponse(_public(meta))

    async def file(self, request: Request) -> Response:
        return JSONResponse(_public(self._owned("files", request)))

    async def content(self, request: Request) -> Response:
        meta = self._owned("files", request)
        data = await asyncio.to_thread(self.store.file_data, meta["id"])
        if data is None:
            raise APIError(404, f"no file {meta['id']}")
        return Response(data, media_type="application/jsonl")

    async def delete_file(self, request: Request) -> Response:
        meta = self._owned("files", request)
        self.store.delete_file(meta["id"])
        return JSONResponse({"id": meta["id"], "object": "file", "deleted": True})

    # ---- batches ----------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        owner = self.owner_of(request)
        body = json_object(await request.body())
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        meta = self.store.load("files", file_id) if isinstance(file_id, str) else None
        if meta is None or meta[OWNER] != owner or meta["purpose"] != "batch":
            raise APIError(400, f"no batch input file {file_id}", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        window = _window_s(body.get("completion_window"))
        metadata = _metadata(body.get("metadata"))
        active = sum(1 for b in self.store.all("batches") if b[OWNER] == owner and b["status"] in ACTIVE)
        if active >= self.limits.max_active:
            raise APIError(429, f"{active} batches of this key are not finished: at most {self.limits.max_active}",
                           headers={"Retry-After": "60"})
        now = int(time.time())
        batch = {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": file_id, "completion_window": body["completion_window"], "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + window, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                 OWNER: owner, "retain_until": self._retain_until(now + window), "created": time.time()}
        self.store.save("batches", batch)
        self.runner.submit(batch)
        return JSONResponse(_public(batch))

    async def batch(self, request: Request) -> Response:
        return JSONResponse(_public(self._owned("batches", request)))

    async def cancel(self, request: Request) -> Response:
        return JSONResponse(_public(self.runner.cancel(self._owned("batches", request))))

    async def list(self, request: Request) -> Response:
        owner = self.owner_of(request)
        mine = sorted((self.runner.view(b["id"]) or b for b in self.store.all("batches") if b[OWNER] == owner),
                      key=lambda b: -b["created"])
        after = request.query_params.get("after")
        if after is not None:
            ids = [b["id"] for b in mine]
            mine = mine[ids.index(after) + 1:] if after in ids else []
        try:
            limit = min(max(int(request.query_params.get("limit", "20")), 1), 100)
        except ValueError:
            raise APIError(400, "limit must be an integer", "limit") from None
        page = [_public(b) for b in mine[:limit]]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(mine) > limit})

    # ---- shared -----------------------------------------------------------------------------------------
    def _owned(self, kind: str, request: Request) -> dict[str, Any]:
        """The owner's object the path names (a running batch as it is now); 404 for anyone else's."""
        owner, obj_id = self.owner_of(request), request.path_params["id"]
        obj = self.runner.view(obj_id) if kind == "batches" else self.store.load(kind, obj_id)
        if obj is None or obj.get(OWNER) != owner:
            raise APIError(404, f"no {kind[:-1]} {obj_id}", "id")
        return obj

    def _retain_until(self, t: float) -> int:
        return int(t + self.limits.retention_h * 3600)

    def sweep(self) -> None:
        """Forget the files and ended batches kept past their retention."""
        now = time.time()
        for f in self.store.all("files"):
            if (f.get("expires_at") or now + 1) < now:
                self.store.delete_file(f["id"])
        for b in self.store.all("batches"):
            if b["status"] not in ACTIVE and b.get("retain_until", now + 1) < now:
                self.store.drop_batch(b["id"])


def _public(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in PRIVATE}


def _window_s(value: Any) -> int:
    m = WINDOW.match(value) if isinstance(value, str) else None
    seconds = int(m.group(1)) * UNITS[m.group(2)] if m else 0
    if not 0 < seconds <= 24 * 3600:
        raise APIError(400, "completion_window must be `24h` (or a shorter window: `<n>h`, `<n>m`, `<n>s`)",
                       "completion_window")
    return seconds


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > 16
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in value.items())):
        raise APIError(400, "metadata must be at most 16 string pairs (keys 64, values 512 characters)", "metadata")
    return value
