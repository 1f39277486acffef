"""A worker behind a shared secret answers only its router (probes stay open)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from fleetllm.server.worker_secret import RequireSecret


def app() -> TestClient:
    async def ok(request):
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/health", "/ready", "/v1/models", "/kv/events")])
    return TestClient(RequireSecret(inner, "s3cret"))


def test_requests_without_the_secret_get_401_in_openai_form():
    c = app()
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        r = c.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "s3cret" not in r.text
    assert c.post("/kv/events").status_code == 401


def test_the_router_with_the_secret_gets_through_and_probes_need_none():
    c = app()
    assert c.get("/v1/models", headers={"authorization": "Bearer s3cret"}).text == "ok"
    assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
