"""A hostile client is refused cheaply, hurts no other request, and cannot reach another tenant's turns.

Each hostile body is a 4xx before anything is allocated or tokenised for it (a 5,000-digit integer, a NaN, four
million prompts, a 15 MB Responses item, a KV frame header claiming terabytes, a NaN lease), from the worker and
from the router, which both stay healthy; a request with a parameter no step could survive, sent among innocent
ones, fails alone. Over the session's simulated worker and router, and its real worker for what needs a model.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fleet_helpers import ThreadServers, router

from fleetllm.disagg import frame
from fleetllm.router.keys import KeyStore

HUGE = 15 * 2**20


def _prompts(n: int) -> bytes:
    return b'{"prompt": [' + b",".join([b'"a"'] * n) + b"]}"


HOSTILE: dict[str, tuple[str, Callable[[], bytes]]] = {  # what a client sends: path, body
    "5000-digit integer": ("/v1/completions", lambda: b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    "NaN temperature": ("/v1/completions", lambda: b'{"prompt": "Hi", "temperature": NaN}'),
    "top_k 2**63": ("/v1/completions", lambda: json.dumps({"prompt": "Hi", "top_k": 2**63}).encode()),
    "4 million prompts": ("/v1/completions", lambda: _prompts(4_000_000)),
    "15 MB junk Responses item": ("/v1/responses", lambda: json.dumps(
        {"input": [{"type": "message", "role": "user", "content": "Hi", "junk": "x" * HUGE}]}).encode()),
    "15 MB Responses text": ("/v1/responses", lambda: json.dumps({"input": "x" * HUGE}).encode()),
}


@pytest.mark.parametrize("server", ["sim", "sim_router"])
@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_body_is_a_4xx_and_the_server_stays_healthy(server: str, case: str, request) -> None:
    url = request.getfixturevalue(server).url
    path, body = HOSTILE[case]
    r = httpx.post(url + path, content=body(), headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500 and r.json()["error"]["code"] == r.status_code, r.text[:300]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_step_breaking_parameter_among_innocent_requests_fails_only_its_request(worker) -> None:
    innocent = {"prompt": "The days of the week are", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(worker.url + "/v1/completions", json=innocent, timeout=60).json()["choices"][0]["text"]

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=worker.url, timeout=60) as client:
            bodies = [innocent, {**innocent, "temperature": 0.7, "top_k": 2**63}, innocent, innocent]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    rs = asyncio.run(together())
    assert rs[1].status_code == 400 and rs[1].json()["error"]["param"] == "top_k", rs[1].text
    assert [r.status_code for r in rs[:1] + rs[2:]] == [200, 200, 200]
    assert all(r.json()["choices"][0]["text"] == alone for r in rs[:1] + rs[2:])


@pytest.mark.parametrize("lease", [b'"NaN"', b"NaN", b'"1e999"', b"-1"])
def test_a_lease_that_is_no_finite_positive_number_is_refused(worker, lease: bytes) -> None:
    header = json.dumps(frame.FrameHeader("smollm2-135m", 30, 3, 64, "float32", 16, [], []).to_json()).encode()
    r = httpx.post(worker.url + "/pd/reserve", content=b'{"header": ' + header + b', "lease_s": ' + lease + b"}",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text


def _head(header: frame.FrameHeader) -> bytes:
    h = json.dumps(header.to_json()).encode()
    return frame.MAGIC + struct.pack("<HI", frame.VERSION, len(h)) + h


def _claiming(what: str, max_model_len: int) -> bytes:
    """A frame's first bytes, claiming a frame far larger than the receiving engine could hold."""
    if what == "header-length":  # a 4 GiB header
        return frame.MAGIC + struct.pack("<HI", frame.VERSION, 0xFFFFFFFF) + b"{"
    if what == "layers":  # a trillion layers
        return _head(frame.FrameHeader("smollm2-135m", 10**12, 3, 64, "float32", 16, [], []))
    n = (max_model_len // 16 + 1) * 16  # more tokens than the context holds
    return _head(frame.FrameHeader("smollm2-135m", 30, 3, 64, "float32", 16, list(range(n)), list(range(n // 16))))


@pytest.mark.parametrize("what", ["header-length", "layers", "tokens"])
def test_a_frame_header_claiming_a_huge_frame_is_refused_before_its_buffer_is_made(worker, what: str) -> None:
    head = _claiming(what, worker.worker.engine.max_model_len)
    r = httpx.post(worker.url + "/pd/kv", content=head, headers={"content-type": "application/octet-stream"},
                   timeout=60)
    assert r.status_code == 400 and "frame" in r.json()["error"]["message"], r.text[:300]
    assert httpx.get(worker.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("interval", ["nan", "0", "-1", "abc"])
def test_a_kv_events_interval_out_of_range_is_refused(sim, interval: str) -> None:
    r = httpx.get(sim.url + "/kv/events", params={"interval": interval}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "interval"


# ---- tenants: a router with API keys ------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(sim, tmp_path_factory) -> Iterator[tuple[ThreadServers, dict[str, str]]]:
    store = KeyStore(tmp_path_factory.mktemp("keys") / "keys.yaml")
    keys = {name: store.create(name, **limits)[1] for name, limits in
            {"a": {}, "b": {}, "metered": {"rpm_limit": 2}, "admin": {"admin": True}}.items()}
    r = router(sim.urls, "round_robin", "--keys-file", str(store.path))
    try:
        for _ in range(400):
            if httpx.get(r.url + "/health", timeout=10).status_code == 200:
                break
            time.sleep(0.05)
        yield r, keys
    finally:
        r.stop()


def _as(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_another_keys_previous_response_id_is_not_found(keyed) -> None:
    r, keys = keyed
    first = httpx.post(r.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 4}, headers=_as(keys["a"]),
                       timeout=60)
    assert first.status_code == 200, first.text
    follow = {"input": "And then?", "max_output_tokens": 4, "previous_response_id": first.json()["id"]}
    assert httpx.post(r.url + "/v1/responses", json=follow, headers=_as(keys["b"]), timeout=60).status_code == 404
    assert httpx.post(r.url + "/v1/responses", json=follow, headers=_as(keys["a"]), timeout=60).status_code == 200


def test_tokenize_counts_against_the_keys_limits_and_usage(keyed) -> None:
    r, keys = keyed
    answers = [httpx.post(r.url + "/tokenize", json={"prompt": "Hello there"}, headers=_as(keys["metered"]),
                          timeout=30) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    usage = httpx.get(r.url + "/admin/usage", headers=_as(keys["admin"]), timeout=10).json()["keys"]
    metered = next(k for k in usage if k["name"] == "metered")
    assert metered["requests"] == 2 and metered["prompt_tokens"] == 2 * answers[0].json()["count"]
