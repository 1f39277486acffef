"""Request tracing: one OTLP span per HTTP request, with its phases as child spans.

The engine keeps each request's phase boundaries (:class:`~fleetllm.engine.outputs.RequestTiming`);
spans are built from them after the request ends, so tracing adds nothing to the step loop. A W3C
``traceparent`` header makes the request's span a child of the caller's (router -> worker); the
request id (``x-request-id``) is a span attribute and appears in the worker's log line.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from fleetllm.engine.outputs import RequestOutput, RequestTiming
from fleetllm.observability.otlp import otlp_url


def trace_id_of(headers: Mapping[str, str]) -> str | None:
    """The trace id of a W3C ``traceparent`` header (``00-<trace id>-<parent id>-<flags>``), if valid."""
    parts = (headers.get("traceparent") or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def phases(t: RequestTiming) -> list[tuple[str, float, float]]:
    """(name, start, end) of queue, prefill and decode as far as the request got (monotonic seconds)."""
    out = []
    if t.scheduled is not None:
        out.append(("queue", t.arrival, t.scheduled))
        if t.first_token is not None:
            out.append(("prefill", t.scheduled, t.first_token))
            out.append(("decode", t.first_token, t.finished))
        else:
            out.append(("prefill", t.scheduled, t.finished))
    else:
        out.append(("queue", t.arrival, t.finished))
    return out


class RequestTracer:
    """Exports request spans over OTLP/HTTP (batched, off the request path)."""

    def __init__(self, endpoint: str, resource) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_url(endpoint, "traces"), timeout=5),
                               schedule_delay_millis=1000))
        self.tracer = self.provider.get_tracer("fleetllm")
        self.propagator = TraceContextTextMapPropagator()

    def record(self, request_id: str, headers: Mapping[str, str], operation: str, model: str,
               start_monotonic: float, finals: Sequence[RequestOutput], status: int = 200) -> None:
        """One request: a SERVER span ``{operation} {model}`` from ``start_monotonic`` to now, and for
        each finished choice its queue / prefill / decode spans."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        now = time.monotonic()
        offset_ns = time.time_ns() - int(now * 1e9)

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        ctx = self.propagator.extract(dict(headers))
        span = self.tracer.start_span(f"{operation} {model}", context=ctx, kind=SpanKind.SERVER,
                                      start_time=ns(start_monotonic))
        span.set_attribute("fleetllm.request_id", request_id)
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("http.response.status_code", status)
        if finals:
            span.set_attribute("gen_ai.usage.input_tokens", sum(f.num_prompt_tokens for f in finals[:1]))
            span.set_attribute("gen_ai.usage.output_tokens", sum(f.num_output_tokens for f in finals))
            span.set_attribute("gen_ai.response.finish_reasons", [f.finish_reason or "" for f in finals])
        if status >= 400 or any(f.error for f in finals):
            span.set_status(Status(StatusCode.ERROR))
        parent = trace.set_span_in_context(span)
        for choice, f in enumerate(finals):
            if f.timing is None:
                continue
            for name, a, b in phases(f.timing):
                child = self.tracer.start_span(name, context=parent, start_time=ns(a))
                child.set_attribute("fleetllm.request_id", request_id)
                child.set_attribute("fleetllm.choice", choice)
                if name == "prefill":
                    child.set_attribute("fleetllm.cached_tokens", f.num_cached_tokens)
                child.end(end_time=ns(b))
        span.end(end_time=ns(now))

    def shutdown(self) -> None:
        self.provider.shutdown()
