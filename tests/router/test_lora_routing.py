"""The router and LoRA adapters: it learns from the workers which copy holds which adapter, sends an adapter's
requests to a copy holding it (spilling when the holders are busy), lists adapters, fans loads out with the admin
credential, scopes keys to adapters and labels its counts with ``lora_name``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fleet_helpers import ADMIN, router, sim_workers, smollm2_adapter, wait_state

from fleetllm.router.index import PrefixIndex
from fleetllm.router.keys import KeyStore
from fleetllm.router.policies import CostModel, PrefixAware, RouteRequest
from fleetllm.router.upstream import WorkerState


def worker(name: str, resident: set[str], inflight: int = 0, queued: int = 0) -> WorkerState:
    w = WorkerState(name, f"http://{name}", healthy=True, model="m", block_size=16, inflight=inflight,
                    waiting=inflight, queued_prefill_tokens=queued)
    w.adapters, w.resident_adapters = frozenset({"a", "b"}), frozenset(resident)
    return w


def test_kv_aware_sends_an_adapter_to_its_holder_while_waiting_there_costs_less_than_a_load() -> None:
    policy = PrefixAware("kv_aware", PrefixIndex(0.0), CostModel(lora_load_s=0.5), seed=1)
    req = RouteRequest(num_prompt_tokens=64, block_size=16, lora_name="a")
    holder, other = worker("h", {"a"}, inflight=1, queued=64), worker("o", {"b"})
    assert policy.choose(req, [holder, other]).worker is holder
    busy = worker("h", {"a"}, inflight=1, queued=4000)  # seconds of prefill queued: more than loading elsewhere
    assert policy.choose(req, [busy, other]).worker is other


def test_an_adapters_holder_past_the_bounded_load_limit_still_takes_its_requests() -> None:
    policy = PrefixAware("kv_aware", PrefixIndex(0.0), CostModel(lora_load_s=0.5), seed=1)
    req = RouteRequest(num_prompt_tokens=64, block_size=16, lora_name="a")
    holder = worker("h", {"a"}, inflight=3)  # above 1.25 x the mean in flight: a prefix would spill here
    others = [worker(f"o{i}", {"b"}) for i in range(3)]
    assert policy.choose(req, [holder, *others]).worker is holder


def test_a_base_model_request_pays_no_adapter_cost() -> None:
    cost = CostModel(lora_load_s=0.5)
    w = worker("w", set())
    assert cost.cost(w, 10, None) + 0.5 == pytest.approx(cost.cost(w, 10, "a"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], str, Path]]:
    """Two simulated copies serving adapters a1 and a2, one resident slot each (a1 warm on the first, a2 on the
    second), behind a kv_aware router."""
    root = tmp_path_factory.mktemp("adapters")
    paths = {n: smollm2_adapter(root / n, seed=i) for i, n in enumerate(("a1", "a2", "a3"))}
    workers = sim_workers(2, "--enable-lora", "--max-loras", "1", "--lora-modules", f"a1={paths['a1']}",
                          f"a2={paths['a2']}")
    r = router(workers.urls, "kv_aware")
    try:
        for url, name in zip(workers.urls, ("a1", "a2"), strict=True):
            assert httpx.post(url + "/v1/completions", json={"model": name, "prompt": "warm", "max_tokens": 1}).status_code == 200
        wait_state(r.url, lambda s: [w.get("resident_adapters") for w in s["workers"]] == [["a1"], ["a2"]])
        yield workers.urls, r.url, root
    finally:
        r.stop()
        workers.stop()


def ask(url: str, model: str, prompt: str = "Tell me about rivers.") -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2})


def test_an_adapters_requests_go_to_the_copy_holding_it(fleet) -> None:  # noqa: ANN001
    workers, url, _ = fleet
    for i in range(6):
        for name, holder in (("a1", workers[0]), ("a2", workers[1])):
            r = ask(url, name, f"question {i} about {name}")
            assert r.status_code == 200 and r.json()["model"] == name
            assert r.headers["x-fleetllm-worker"] == holder.removeprefix("http://")
    metrics = httpx.get(url + "/metrics?federate=0").text
    assert 'fleetllm_router_lora_requests_total{lora_name="a1",model="smollm2-135m",resident="true"} 6.0' in metrics


def test_the_router_lists_adapters_with_their_parent_and_404s_an_unknown_one(fleet) -> None:  # noqa: ANN001
    _, url, _ = fleet
    cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert cards["a1"]["parent"] == cards["a2"]["parent"] == "smollm2-135m"
    r = ask(url, "a9")
    assert r.status_code == 404 and "adapters: a1, a2" in r.json()["error"]["message"]


def test_loads_through_the_router_need_the_admin_credential_and_reach_every_copy(fleet) -> None:  # noqa: ANN001
    workers, url, root = fleet
    body = {"lora_name": "a3", "lora_path": str(root / "a3")}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN)
    assert r.status_code == 200 and [c["status"] for c in r.json()["workers"]] == [200, 200]
    assert all("a3" in [m["id"] for m in httpx.get(w + "/v1/models").json()["data"]] for w in workers)
    wait_state(url, lambda s: all("a3" in w.get("adapters", []) for w in s["workers"]))
    assert ask(url, "a3").status_code == 200
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=ADMIN).status_code == 200
    wait_state(url, lambda s: all("a3" not in w.get("adapters", []) for w in s["workers"]))
    assert ask(url, "a3").status_code == 404


def test_a_refused_load_is_the_workers_status_with_each_copys_answer(fleet, tmp_path: Path) -> None:  # noqa: ANN001
    _, url, _ = fleet
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, headers=ADMIN)
    assert r.status_code == 403 and len(r.json()["workers"]) == 2


def test_a_key_may_be_scoped_to_an_adapter(fleet, tmp_path: Path) -> None:  # noqa: ANN001
    workers, _, _ = fleet
    _, key = KeyStore(tmp_path / "keys.yaml").create("tenant", models=["a1"])
    r = router(workers, "kv_aware", "--keys-file", str(tmp_path / "keys.yaml"))
    try:
        wait_state(r.url, lambda s: all(w["healthy"] and w.get("adapters") for w in s["workers"]))
        auth = {"authorization": f"Bearer {key}"}
        ok = httpx.post(r.url + "/v1/completions", headers=auth, json={"model": "a1", "prompt": "x", "max_tokens": 1})
        base = httpx.post(r.url + "/v1/completions", headers=auth,
                          json={"model": "smollm2-135m", "prompt": "x", "max_tokens": 1})
    finally:
        r.stop()
    assert ok.status_code == 200 and base.status_code == 403


def test_the_router_state_shows_each_copys_adapters(fleet) -> None:  # noqa: ANN001
    _, url, _ = fleet
    state = httpx.get(url + "/router/state", headers=ADMIN).json()
    assert [sorted(w["adapters"]) for w in state["workers"]] == [["a1", "a2"], ["a1", "a2"]]


def test_the_router_hashes_an_adapters_blocks_as_the_worker_caches_them(fleet) -> None:  # noqa: ANN001
    from fleetllm.models.source import load_tokenizer
    from fleetllm.router.tokens import block_hashes

    _, url, _ = fleet
    prompt = "A long question about the rivers of Europe and where each of them meets the sea. " * 4
    r = ask(url, "a1", prompt)
    assert r.status_code == 200
    ids = load_tokenizer("smollm2-135m")[1].encode(prompt)
    mine, base = block_hashes(ids, 16, "smollm2-135m", "a1"), block_hashes(ids, 16, "smollm2-135m")
    for _ in range(100):  # the worker's KV events reach the router's exact index within a moment
        state = httpx.get(url + "/router/state?hashes=1", headers=ADMIN).json()
        exact = set(next(w for w in state["workers"] if w["name"] == r.headers["x-fleetllm-worker"])["exact_hashes"])
        if set(mine) <= exact:
            break
        time.sleep(0.05)
    assert set(mine) <= exact
    assert not set(base) & exact  # the base model's blocks are other blocks
