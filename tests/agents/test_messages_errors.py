"""/v1/messages answers errors in Anthropic's body shape, from the worker and from the router."""

from __future__ import annotations

import httpx
import pytest
from fleet_helpers import router, wait_state


@pytest.fixture(scope="module")
def fleet_router(worker):
    r = router([worker.url], "round_robin")
    try:
        wait_state(r.url, lambda st: all(w["healthy"] for w in st["workers"]))
        yield r
    finally:
        r.stop()


def test_a_bad_request_is_an_anthropic_invalid_request_error(worker, fleet_router):
    for url in (worker.url, fleet_router.url):
        r = httpx.post(url + "/v1/messages", json={"model": "smollm2-135m", "messages": []}, timeout=10)
        assert r.status_code == 400
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": r.json()["error"]["message"]}}
        assert "max_tokens" in r.json()["error"]["message"]


def test_an_unknown_model_is_a_not_found_error_through_the_router(fleet_router, anthropic):
    client = anthropic.Anthropic(base_url=fleet_router.url, api_key="-", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": e.value.body["error"]["message"]}}


def test_other_endpoints_keep_the_openai_error_shape(fleet_router):
    r = httpx.post(fleet_router.url + "/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "type" not in r.json()
