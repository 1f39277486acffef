"""Hostile clients against a fleet's router and workers: nothing opens without its credential.

The fleet here is what ``fleetllm serve`` runs, in-process: a simulated worker and a router sharing a worker
secret, the router holding the tests' admin token. Each case is one hostile request and the answer it must get.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from unittest import mock

import httpx
import pytest
from fleet_helpers import ADMIN, ThreadServers, router, sim_workers, wait_state

from fleetllm.router.admin import admin_routes
from fleetllm.server.worker_secret import ENV

SECRET = "the-fleets-worker-secret"
WORKER = {"authorization": f"Bearer {SECRET}"}
ADMIN_ROUTES = [(m, r.path) for r in admin_routes(None) for m in sorted(r.methods - {"HEAD"})] + [
    ("GET", "/router/state")]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[ThreadServers, ThreadServers]]:
    """A worker and its router, both given the fleet's secret as ``fleetllm serve`` gives it (environment)."""
    with mock.patch.dict(os.environ, {ENV: SECRET}):
        w = sim_workers(1, "--sim-speed", "20")
        r = router(w.urls, "round_robin")
    try:
        wait_state(r.url, lambda s: all(x["healthy"] and x["events_connected"] for x in s["workers"]))
        yield w, r
    finally:
        r.stop()
        w.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module's requests (making one per request costs more than the request)."""
    with httpx.Client(timeout=30) as c:
        yield c


def _openai_error(r: httpx.Response, status: int) -> bool:
    err = r.json().get("error", {})
    return r.status_code == status and err.get("code") == status and bool(err.get("message"))


def _worker_paths(app: object) -> list[str]:
    """Every route path of a worker's app (under its middleware), and one it does not have."""
    while not hasattr(app, "routes"):
        app = app.app  # type: ignore[attr-defined]
    return [r.path for r in app.routes] + ["/no/such/path"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("method,path", ADMIN_ROUTES)
def test_an_admin_route_without_credentials_is_401(fleet, http: httpx.Client, method: str, path: str) -> None:
    r = http.request(method, fleet[1].url + path, json={"url": "http://127.0.0.1:8399"})
    assert _openai_error(r, 401), r.text


@pytest.mark.parametrize("method,path", ADMIN_ROUTES)
def test_the_worker_secret_opens_no_admin_route(fleet, http: httpx.Client, method: str, path: str) -> None:
    r = http.request(method, fleet[1].url + path, json={"url": "http://127.0.0.1:8399"}, headers=WORKER)
    assert _openai_error(r, 403), r.text


@pytest.mark.parametrize("path", ["/router/state/", "//router/state", "/router/%73tate", "/router/state?hashes=1",
                                  "/admin/usage/", "/admin//usage"])
def test_a_disguised_admin_path_shows_nothing(fleet, http: httpx.Client, path: str) -> None:
    r = http.get(fleet[1].url + path, headers=WORKER)
    assert r.status_code in (307, 403, 404) and '"url"' not in r.text and '"keys":' not in r.text, r.text


def test_a_rogue_worker_is_not_registered_and_the_real_one_not_drained(fleet, http: httpx.Client) -> None:
    w, r = fleet
    for headers in ({}, WORKER, {"authorization": "Bearer guess"}):
        http.post(r.url + "/admin/workers", json={"url": "http://127.0.0.1:8399"}, headers=headers)
        http.post(r.url + "/admin/workers/drain", json={"url": w.url}, headers=headers)
    state = http.get(r.url + "/router/state", headers=ADMIN).json()
    assert [(x["url"], x["draining"]) for x in state["workers"]] == [(w.url, False)]


def test_every_path_of_a_fleets_worker_is_401_without_the_secret(fleet, http: httpx.Client) -> None:
    w = fleet[0]
    paths = [p for p in _worker_paths(w.servers[0].config.app) if p not in ("/health", "/ready")]
    assert any(p.startswith("/pd/") for p in paths) and "/v1/completions" in paths
    for path in paths:
        for headers in ({}, {"authorization": "Bearer guess"}):
            r = http.post(w.url + path, json={"prompt": "hi"}, headers=headers)
            assert _openai_error(r, 401), (path, r.text)
            assert r.headers["www-authenticate"] == 'Bearer realm="fleetllm-worker"'


def test_the_router_presents_the_secret_to_its_worker(fleet, http: httpx.Client) -> None:
    w, r = fleet
    body = {"prompt": "hi", "max_tokens": 2}
    assert http.post(r.url + "/v1/completions", json=body).status_code == 200  # the router's own secret upstream
    assert http.post(w.url + "/v1/completions", json=body, headers=WORKER).status_code == 200
    assert http.get(r.url + "/metrics").text.count(f'worker="{w.url[7:]}"') > 0  # federated: read


def test_probes_stay_open_and_tell_nothing_but_a_status(fleet, http: httpx.Client) -> None:
    w, r = fleet
    for url in (w.url + "/health", w.url + "/ready", r.url + "/health"):
        got = http.get(url)
        assert got.status_code == 200 and list(got.json()) == ["status"], got.text


def test_credentials_are_checked_before_a_body_is_read_and_admin_bodies_are_small(fleet, http: httpx.Client) -> None:
    r = fleet[1]
    big = b'{"url": "' + b"a" * (4 * 2**20) + b'"}'
    refused = http.post(r.url + "/admin/workers", content=big)
    assert _openai_error(refused, 401)  # not a 413: the body was never read
    too_big = http.post(r.url + "/admin/workers", content=big, headers=ADMIN)
    assert _openai_error(too_big, 413)
