"""Request ids: a client's ``x-request-id`` is a label, never a key; the router mints its own id."""

from __future__ import annotations

import json
import threading

import httpx

from fleetllm.router.request_id import mint


def _stream_all(url: str, rid: str, max_tokens: int, first: threading.Event) -> dict:
    body = {"prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage, finish = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            first.set()
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev.get("choices", []):
                finish = c.get("finish_reason") or finish
    return {"usage": usage, "finish": finish}


def test_a_duplicate_client_id_in_flight_leaves_the_first_request_alone(sim) -> None:
    first, result = threading.Event(), {}
    t = threading.Thread(target=lambda: result.update(_stream_all(sim.url, "dup", 40, first)))
    t.start()
    assert first.wait(30)
    second = httpx.post(sim.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                        headers={"x-request-id": "dup"}, timeout=30)
    t.join(60)
    assert second.status_code == 200, second.text
    assert second.headers["x-request-id"] == "dup"
    assert not t.is_alive(), "the first request hung"
    assert result["finish"] == "length" and result["usage"]["completion_tokens"] == 40


def test_router_mints_its_own_id_and_passes_both_to_the_worker(sim_router) -> None:
    r1 = httpx.post(sim_router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                    headers={"x-request-id": "client-7"}, timeout=30)
    r2 = httpx.post(sim_router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                    headers={"x-request-id": "client-7"}, timeout=30)
    assert r1.status_code == r2.status_code == 200
    assert r1.headers["x-request-id"] == r2.headers["x-request-id"] == "client-7"
    # the worker echoes the id the router minted: each request its own
    ids = {r1.headers["x-fleetllm-request-id"], r2.headers["x-fleetllm-request-id"]}
    assert len(ids) == 2 and "client-7" not in ids
    assert r1.json()["id"] != r2.json()["id"]


def test_minted_ids_are_unique() -> None:
    ids = [mint() for _ in range(10_000)]
    assert len(set(ids)) == len(ids) and all(isinstance(i, str) and i for i in ids)
