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


def test_an_api_key_opens_the_client_api_but_never_the_peer_endpoints():
    async def ok(request):
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route(p, ok, methods=["POST"]) for p in ("/v1/completions", "/pd/kv")])
    key = {"authorization": "Bearer client-key"}
    c = TestClient(RequireSecret(inner, None, "client-key"))
    assert c.post("/v1/completions", headers=key).text == "ok"
    assert c.post("/v1/completions").status_code == 401
    assert c.post("/pd/kv", headers=key).status_code == 401  # P/D takes the fleet's secret only
    both = TestClient(RequireSecret(inner, "s3cret", "client-key"))
    assert both.post("/pd/kv", headers={"authorization": "Bearer s3cret"}).text == "ok"
    assert both.post("/pd/kv", headers=key).status_code == 401


def test_the_secret_may_come_from_a_mounted_file(tmp_path, monkeypatch):
    from fleetllm.server.worker_secret import ENV, FILE_ENV, worker_secret

    (tmp_path / "secret").write_text("from-a-file\n")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv(FILE_ENV, str(tmp_path / "secret"))
    assert worker_secret() == "from-a-file"


def test_a_worker_with_no_credential_warns_only_beyond_loopback(caplog):
    from fleetllm.server.worker_secret import warn_if_open

    assert not warn_if_open("127.0.0.1", None, None) and not warn_if_open("::1", None, None)
    assert not warn_if_open("0.0.0.0", "s3cret", None) and not warn_if_open("0.0.0.0", None, "key")
    assert warn_if_open("0.0.0.0", None, None)
    assert "no credential" in caplog.text
