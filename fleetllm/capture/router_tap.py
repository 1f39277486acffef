"""The router's two tiers: ``endpoint`` (request body and final answer) and ``access`` (one line per request).

The gateway opens a :class:`RequestTap` when a completion request arrives and hands it the response it
is about to return; the tap records when the answer is complete. A plain response is recorded at once;
a stream is watched as it is relayed (assembled, never buffered as SSE) and recorded as its ``[DONE]``
event passes, before that last byte goes out; a stream the client or the worker broke off is recorded
when it ends, marked ``aborted``. Headers are never captured: the client's credentials stay out. A
request refused for its credentials (401, 403) gets its access line only: its body is never read here.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fleetllm.capture.recorder import Capture
from fleetllm.capture.records import REFUSED, access_record, endpoint_record, iso_time, payload
from fleetllm.capture.stream import StreamAssembler

if TYPE_CHECKING:
    from fleetllm.router.forward import Forward


class RequestTap:
    """What the router saw of one request, recorded once its answer is complete."""

    def __init__(self, capture: Capture, request: Request, request_id: str, endpoint: bool, access: bool) -> None:
        self.capture, self.request, self.request_id = capture, request, request_id
        self.endpoint, self.access = endpoint, access
        self.arrived = time.time()
        self.t0 = time.perf_counter()
        self.key_id: str | None = None
        self.fwd: Forward | None = None  # set once the request is on its way to a worker
        self.raw = b""
        self.count_prompt: Callable[[], int] | None = None  # the router's tokenizer, for streams without usage

    async def finish(self, response: Response) -> Response:
        """Record ``response`` (now, or as its stream ends) and return it to be sent."""
        if response.status_code in REFUSED:
            self.endpoint = False
            self._record(response.status_code, None, None, len(getattr(response, "body", b"")), time.perf_counter(),
                         False)
            return response
        self.raw = await self.request.body()  # read already: starlette keeps it
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._relay(response.body_iterator, response.status_code)
            return response
        body = bytes(response.body)
        self._record(response.status_code, body, None, len(body), time.perf_counter(), aborted=False)
        return response

    async def _relay(self, chunks: AsyncIterator[Any], status: int) -> AsyncIterator[Any]:
        asm = StreamAssembler() if self.endpoint else None
        sent, first, recorded, completed = 0, None, False, False
        try:
            async for chunk in chunks:
                first = first or time.perf_counter()
                sent += len(chunk)
                if asm is not None:
                    asm.feed(chunk)
                if not recorded and b"data: [DONE]" in chunk:
                    recorded = True
                    self._record(status, None, asm, sent, first, aborted=False)
                yield chunk
            completed = True
        finally:
            if not recorded:
                self._record(status, None, asm, sent, first, aborted=not completed)

    def _record(self, status: int, body: bytes | None, asm: StreamAssembler | None, bytes_out: int,
                first: float | None, aborted: bool) -> None:
        with self.capture.guard("access"):
            if self.access:
                self.capture.write("access", access_record(self._access_values(status, bytes_out, first, aborted)))
        with self.capture.guard("endpoint"):
            if self.endpoint:
                self._endpoint(status, body, asm, aborted)

    def _access_values(self, status: int, bytes_out: int, first: float | None, aborted: bool) -> dict[str, Any]:
        now, fwd = time.perf_counter(), self.fwd
        client = self.request.client
        dispatched = fwd.dispatched if fwd and fwd.dispatched else None
        upstream = fwd.first_byte if fwd and fwd.first_byte else None
        return {
            "time": iso_time(self.arrived), "client": client.host if client else None,
            "client_port": client.port if client else None, "method": self.request.method,
            "path": self.request.url.path, "status": 499 if aborted else status, "bytes_in": len(self.raw),
            "bytes_out": bytes_out,
            "request_processing_time": _span(self.t0, dispatched),
            "target_processing_time": _span(dispatched, upstream),
            "response_processing_time": _span(upstream, now),
            "time_to_first_byte": _span(self.t0, first),
            "worker": fwd.worker if fwd and fwd.worker else None, "routing": fwd.reason if fwd and fwd.reason else None,
            "request_id": self.request_id, "client_request_id": self.request.headers.get("x-request-id"),
            "key_id": self.key_id, "model": fwd.body.get("model") if fwd else None,
            "stream": bool(fwd and fwd.stream), "lora_name": fwd.route.lora_name if fwd else None,
        }

    def _endpoint(self, status: int, body: bytes | None, asm: StreamAssembler | None, aborted: bool) -> None:
        c, flags = self.capture, set()
        req_type = (self.request.headers.get("content-type") or "application/json").split(";")[0].strip()
        out_type = "text/event-stream" if asm is not None else "application/json"
        allowed = c.cfg.content_types
        request = response = None
        if c.keeps("input") and req_type in allowed:
            text = c.payload("endpoint", self.raw.decode(errors="replace"), flags, is_json="json" in req_type)
            if text is None:
                c.write("endpoint", None)
                return
            request = payload(text, req_type, "INPUT")
        if c.keeps("output") and out_type in allowed:
            if asm is not None:
                body = json.dumps(asm.result(self._prompt_tokens(asm))).encode()
            text = c.payload("endpoint", (body or b"").decode(errors="replace"), flags, is_json=True)
            if text is None:
                c.write("endpoint", None)
                return
            response = payload(text, "application/json", "OUTPUT")
        extra = {"status": 499 if aborted else status, "stream": asm is not None, "aborted": aborted,
                 "worker": self.fwd.worker if self.fwd else None,
                 "lora_name": self.fwd.route.lora_name if self.fwd else None,
                 "latency_s": round(time.perf_counter() - self.t0, 6)}
        if "truncated" in flags:
            extra["truncated"] = True
        c.write("endpoint", endpoint_record(self.request_id, self.arrived, request, response, extra), flags)


    def _prompt_tokens(self, asm: StreamAssembler) -> int | None:
        asm.parse()
        if asm.usage is not None:
            return None
        counted = self.fwd.route.num_prompt_tokens if self.fwd else 0
        return counted or (self.count_prompt() if self.count_prompt else None)


def _span(start: float | None, end: float | None) -> float:
    """Seconds from ``start`` to ``end``; -1 when either is unknown (as load balancer logs write it)."""
    return round(end - start, 6) if start is not None and end is not None else -1.0


def open_tap(capture: Capture | None, request: Request, request_id: str) -> RequestTap | None:
    """A tap for this request when the endpoint or the access tier captures it, else None."""
    if capture is None:
        return None
    endpoint, access = capture.wants("endpoint", request_id), capture.wants("access", request_id)
    return RequestTap(capture, request, request_id, endpoint, access) if endpoint or access else None
