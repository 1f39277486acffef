"""--otlp-endpoint: the worker pushes the same metrics and one span per request (with queue, prefill
and decode children) to an OTLP/HTTP collector; a W3C traceparent makes that span the caller's child."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from otlp_sink import OTLPSink

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def sink() -> Iterator[OTLPSink]:
    s = OTLPSink()
    yield s
    s.close()


@pytest.fixture(scope="module")
def exporting(worker_factory: Any, sink: OTLPSink) -> Any:
    w = worker_factory("--otlp-endpoint", sink.url, "--otlp-interval", "0.5", "--zone", "zone-otlp")
    r = httpx.post(w.base_url + "/v1/completions", timeout=120,
                   json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
                   headers={"x-request-id": "otlp-req-1", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200
    return w


def eventually(get: Callable[[], Any], deadline_s: float = 30.0) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = get()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail("the OTLP sink never received what was expected")


def metric_named(sink: OTLPSink, name: str) -> Any:
    """The newest export's metric ``name`` once it has recorded a request, else None."""
    for req in reversed(sink.metrics()):
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name and _has_data(m):
                        return rm, m
    return None


def _has_data(m: Any) -> bool:
    kind = m.WhichOneof("data")
    points = getattr(m, kind).data_points
    if kind == "histogram":
        return any(p.count > 0 for p in points)
    return any((p.as_double or p.as_int) > 0 for p in points)


def test_genai_histograms_arrive_with_their_otel_names_and_units(exporting: Any, sink: OTLPSink) -> None:
    rm, m = eventually(lambda: metric_named(sink, "gen_ai.server.time_to_first_token"))
    assert m.unit == "s"
    (point,) = m.histogram.data_points
    assert point.count == 1 and point.sum > 0
    assert list(point.explicit_bounds)[:3] == [0.001, 0.005, 0.01]
    assert sum(point.bucket_counts) == point.count
    attrs = {a.key: a.value.string_value for a in point.attributes}
    assert attrs["model_name"] == "smollm2-135m" and attrs["zone"] == "zone-otlp"
    res = {a.key: a.value.string_value for a in rm.resource.attributes}
    assert res["service.name"] == "fleetllm-worker" and res["fleetllm.zone"] == "zone-otlp"
    assert sink.content_types == {"application/x-protobuf"}


def test_vllm_counters_arrive_as_monotonic_sums(exporting: Any, sink: OTLPSink) -> None:
    def three_tokens() -> Any:  # an export taken while the request ran may hold fewer
        got = metric_named(sink, "vllm:generation_tokens")
        return got if got and sum(p.as_double for p in got[1].sum.data_points) == 3 else None

    _, m = eventually(three_tokens)
    assert m.sum.is_monotonic
    _, usage = eventually(lambda: metric_named(sink, "gen_ai.client.token.usage"))
    types = {a.value.string_value for p in usage.histogram.data_points for a in p.attributes if a.key == "gen_ai.token.type"}
    assert types == {"input", "output"}


def test_request_span_continues_the_callers_trace(exporting: Any, sink: OTLPSink) -> None:
    spans = eventually(lambda: [s for s in sink.spans() if s.trace_id.hex() == TRACE_ID])
    (root,) = [s for s in spans if s.parent_span_id.hex() == PARENT_ID]
    assert root.name == "text_completion smollm2-135m"
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["fleetllm.request_id"].string_value == "otlp-req-1"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 3
    children = eventually(lambda: [s for s in sink.spans() if s.parent_span_id == root.span_id])
    by_name = {c.name: c for c in children}
    assert set(by_name) == {"queue", "prefill", "decode"}
    q, p, d = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert root.start_time_unix_nano <= q.start_time_unix_nano <= q.end_time_unix_nano
    assert q.end_time_unix_nano == p.start_time_unix_nano and p.end_time_unix_nano == d.start_time_unix_nano
    assert d.end_time_unix_nano <= root.end_time_unix_nano


def test_a_request_without_traceparent_starts_a_new_trace(exporting: Any, sink: OTLPSink) -> None:
    httpx.post(exporting.base_url + "/v1/completions", timeout=120,
               json={"prompt": "Hi", "max_tokens": 1}, headers={"x-request-id": "otlp-req-2"})

    def own_root() -> list:
        return [s for s in sink.spans()
                if any(a.key == "fleetllm.request_id" and a.value.string_value == "otlp-req-2" for a in s.attributes)
                and not s.parent_span_id]
    (root,) = eventually(own_root)
    assert root.trace_id.hex() != TRACE_ID
