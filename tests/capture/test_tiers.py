"""The three tiers over a real router and workers: what is captured, exactly once, joinable by id."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from fleetllm.capture.records import ACCESS_FIELDS
from fleetllm.capture.sampling import sampled

SECRET = "sk-live-0123456789abcdef"
CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5}


CLIENT = httpx.Client(timeout=30)  # one client: building one per request costs more than the request


def _send(url: str, body: dict | bytes, path: str = "/v1/chat/completions", client_id: str | None = None) -> httpx.Response:
    # a client id shared by concurrent requests would collide in the worker's engine: each its own
    headers = {"authorization": f"Bearer {SECRET}", "x-request-id": client_id or uuid.uuid4().hex}
    if isinstance(body, bytes):
        return CLIENT.post(url + path, content=body, headers={**headers, "content-type": "application/json"})
    return CLIENT.post(url + path, json=body, headers=headers)


def test_every_answered_request_is_captured_once_at_the_endpoint_and_worker_tiers(capture_fleet, tmp_path: Path):
    fleet = capture_fleet(destination=str(tmp_path / "captures"))
    bodies = [CHAT, {**CHAT, "api_key": SECRET}, {**CHAT, "stream": True},
              {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
              {"model": "smollm2-135m", "prompt": "Once upon", "max_tokens": 4, "stream": True}]
    answers = [_send(fleet.router_url, b, "/v1/completions" if "prompt" in b else "/v1/chat/completions")
               for b in bodies]
    bad = _send(fleet.router_url, b"{not json")
    assert [a.status_code for a in answers] == [200] * 5 and bad.status_code == 400
    ids = [a.headers["x-fleetllm-request-id"] for a in answers]

    endpoint = fleet.records("endpoint")
    worker = fleet.records("worker")
    assert Counter(r["request_id"] for r in worker) == Counter(ids)
    by_id = {r["eventMetadata"]["inferenceId"]: r for r in endpoint}
    assert len(endpoint) == 6 and set(ids) < set(by_id)  # every answer, and the rejected request
    for i in ids:
        out = json.loads(by_id[i]["captureData"]["endpointOutput"]["data"])
        w = next(r for r in worker if r["request_id"] == i)
        assert out["usage"]["completion_tokens"] == w["usage"]["completion_tokens"] > 0
        text = out["choices"][0].get("message", {}).get("content") or out["choices"][0].get("text")
        assert text == w["output"][0]["text"]
        assert out["object"] in ("chat.completion", "text_completion")  # streams too: assembled, not SSE


def test_a_stream_is_captured_as_the_assembled_object_with_usage(capture_fleet, tmp_path: Path):
    fleet = capture_fleet(destination=str(tmp_path / "captures"), tiers=["endpoint"])
    a = _send(fleet.router_url, {**CHAT, "stream": True})
    rec = fleet.records("endpoint")[0]
    assert rec["eventMetadata"]["inferenceId"] == a.headers["x-fleetllm-request-id"]
    assert rec["captureData"]["endpointInput"]["encoding"] == "JSON"
    assert json.loads(rec["captureData"]["endpointInput"]["data"])["messages"] == CHAT["messages"]
    out = json.loads(rec["captureData"]["endpointOutput"]["data"])
    assert out["object"] == "chat.completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5 and out["usage"]["prompt_tokens"] > 0
    assert rec["eventVersion"] == "0" and rec["fleetllm"]["status"] == 200 and rec["fleetllm"]["stream"]


def test_the_access_tier_has_one_line_per_request_with_its_fields_in_order(capture_fleet, tmp_path: Path):
    fleet = capture_fleet(destination=str(tmp_path / "captures"))
    ok = _send(fleet.router_url, CHAT, client_id="client-id-1")
    _send(fleet.router_url, b"[1, 2]")
    lines = fleet.records("access")
    assert [list(r) for r in lines] == [list(ACCESS_FIELDS)] * 2
    good, bad = sorted(lines, key=lambda r: r["status"])
    assert good["status"] == 200 and bad["status"] == 400
    assert good["request_id"] == ok.headers["x-fleetllm-request-id"] and good["client_request_id"] == "client-id-1"
    assert good["worker"] and good["routing"] and good["client"] == "127.0.0.1" and good["bytes_out"] > 0
    assert good["time_to_first_byte"] >= good["target_processing_time"] >= 0
    assert bad["worker"] is None and bad["target_processing_time"] == -1


def test_credentials_never_reach_a_capture(capture_fleet, tmp_path: Path):
    fleet = capture_fleet(destination=str(tmp_path / "captures"), redact=[r"Say \w+"])
    _send(fleet.router_url, {**CHAT, "api_key": SECRET, "user": f"Bearer {SECRET}"})
    fleet.flush()
    written = b"".join(p.read_bytes() for p in (tmp_path / "captures").rglob("*.jsonl"))
    assert written and SECRET.encode() not in written
    assert b"Say hi" not in written and b"[REDACTED]" in written  # the operator's pattern too
    m = httpx.get(fleet.router_url + "/metrics").text
    assert 'fleetllm_capture_records_total{outcome="redacted",tier="endpoint"} 1.0' in m


def test_at_ten_percent_the_same_requests_are_captured_at_every_tier(capture_fleet, tmp_path: Path):
    fleet = capture_fleet(destination=str(tmp_path / "captures"), sampling={"endpoint": "10", "worker": "10"})
    n = 150
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _send(fleet.router_url, {**CHAT, "max_tokens": 1}), range(n)))
    ids = {a.headers["x-fleetllm-request-id"] for a in answers if a.status_code == 200}
    assert len(ids) == n
    endpoint = {r["eventMetadata"]["inferenceId"] for r in fleet.records("endpoint")}
    worker = {r["request_id"] for r in fleet.records("worker")}
    assert endpoint == worker == {i for i in ids if sampled(i, 10)}
    assert 1 <= len(endpoint) <= 33  # 15 expected; 33 is beyond 4.5 standard deviations of Binomial(150, 0.1)
    assert len(fleet.records("access")) == n  # access stays at 100%
    m = httpx.get(fleet.router_url + "/metrics").text
    assert f'fleetllm_capture_records_total{{outcome="sampled_out",tier="endpoint"}} {n - len(endpoint)}.0' in m


def test_a_stream_the_client_breaks_off_is_captured_as_aborted_at_every_tier(capture_fleet, tmp_path: Path):
    import time

    fleet = capture_fleet(destination=str(tmp_path / "captures"))
    with CLIENT.stream("POST", fleet.router_url + "/v1/chat/completions",
                       json={**CHAT, "max_tokens": 4000, "stream": True}) as r:
        rid = r.headers["x-fleetllm-request-id"]
        next(r.iter_raw())  # the first chunk, then the client goes away
    end = time.monotonic() + 20
    while True:
        endpoint, worker = fleet.records("endpoint"), fleet.records("worker")
        if (endpoint and worker) or time.monotonic() > end:
            break
        time.sleep(0.1)
    [e], [w] = endpoint, worker
    assert e["eventMetadata"]["inferenceId"] == w["request_id"] == rid
    assert e["fleetllm"]["aborted"] and e["fleetllm"]["status"] == 499
    assert w["aborted"] and w["status"] == 499 and 0 < w["usage"]["completion_tokens"] < 4000
    [a] = fleet.records("access")
    assert a["status"] == 499 and a["bytes_out"] > 0
