"""A request's priority through the router (checked, forwarded, clamped to its key's floor) and the per-tenant
accounting on /metrics; a simulated worker under --scheduling-policy priority takes and checks the same field."""

from __future__ import annotations

import httpx
import pytest
from fleet_helpers import ThreadServer, router, sim_workers
from prometheus_client.parser import text_string_to_metric_families
from test_shared_limits import ask, upstream

from fleetllm.errors import UsageError
from fleetllm.router.keys import KeyRecord, KeyStore
from fleetllm.router.tenancy import Tenant, tenant_of

BAD = [1.5, "1", True, 2**31, -(2**31) - 1, [0]]


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A router with keys over a fake upstream: (router url, upstream app, keys store)."""
    store = KeyStore(tmp_path_factory.mktemp("keys") / "keys.yaml")
    app = upstream()
    with ThreadServer(app) as up:
        r = router([up.url], "round_robin", "--keys-file", str(store.path))
        yield r.url, app, store
        r.stop()


@pytest.mark.parametrize("value", BAD)
def test_the_router_refuses_a_priority_that_is_not_a_32_bit_integer(keyed, value):
    url, app, store = keyed
    _, key = store.create()
    before = len(app.state.seen)
    resp = httpx.post(url + "/v1/chat/completions", json=chat(priority=value), headers={"authorization": f"Bearer {key}"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
    assert len(app.state.seen) == before  # no worker was asked


def test_a_priority_is_forwarded_untouched(keyed):
    url, app, store = keyed
    _, key = store.create()
    for p in (-(2**31), 7):
        assert httpx.post(url + "/v1/chat/completions", json=chat(priority=p),
                          headers={"authorization": f"Bearer {key}"}).status_code == 200
        assert app.state.seen[-1]["priority"] == p
    assert ask(url, key) == 200 and "priority" not in app.state.seen[-1]


def test_a_keys_priority_floor_clamps_more_urgent_requests_to_it(keyed):
    url, app, store = keyed
    _, key = store.create("batch", priority_floor=10)
    auth = {"authorization": f"Bearer {key}"}
    for asked, served in [(-5, 10), (None, 10), (20, 20)]:
        body = chat() if asked is None else chat(priority=asked)
        assert httpx.post(url + "/v1/chat/completions", json=body, headers=auth).status_code == 200
        assert app.state.seen[-1]["priority"] == served


def test_metrics_count_each_tenants_requests_tokens_queue_time_and_sheds_by_band(keyed):
    url, app, store = keyed
    rec, key = store.create("team-b", rpm_limit=2)
    _, admin = store.create("ops", admin=True)
    auth = {"authorization": f"Bearer {key}"}
    statuses = [httpx.post(url + "/v1/chat/completions", json=chat(priority=-1), headers=auth).status_code
                for _ in range(3)]
    assert statuses == [200, 200, 429]
    text = httpx.get(url + "/metrics?federate=0", headers={"authorization": f"Bearer {admin}"}).text
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def value(name: str, **extra: str) -> float:
        return samples[(name, frozenset({"key": rec.id, "name": "team-b", "band": "high", **extra}.items()))]

    assert value("fleetllm_tenant_requests_total") == 2
    assert value("fleetllm_tenant_tokens_total", kind="prompt") == 6
    assert value("fleetllm_tenant_tokens_total", kind="completion") == 2
    assert value("fleetllm_tenant_shed_total", reason="rpm_limit") == 1
    assert value("fleetllm_tenant_queue_seconds_count") == 2
    assert key not in text


def test_a_worker_under_priority_scheduling_serves_a_priority_and_refuses_a_bad_one(procs):
    sims = sim_workers(1, "--scheduling-policy", "priority")
    procs.append(sims)
    body = {"model": "smollm2-135m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(sims.url + "/v1/chat/completions", json={**body, "priority": -3}, timeout=30).status_code == 200
    bad = httpx.post(sims.url + "/v1/chat/completions", json={**body, "priority": 2**31}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_a_requests_tenant_is_its_key_with_the_keys_weight_else_its_tenant_header_else_its_user():
    rec = KeyRecord("ab" * 32, name="team", weight=3.0)
    assert tenant_of(rec, {"x-tenant-id": "ignored"}, {}) == Tenant(rec.id, 3.0, rec)
    assert tenant_of(None, {"x-tenant-id": "t1"}, {"user": "u1"}).id == "t1"
    assert tenant_of(None, {}, {"user": "u1"}).id == "u1"
    assert tenant_of(None, {}, {}).id == "none"


def test_a_keys_file_weight_must_be_a_positive_number(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n- {hash: abc, weight: 0}\n")
    with pytest.raises(UsageError, match=r"keys\[0\].weight"):
        KeyStore(path)
