"""A worker serves LoRA adapters as vLLM does: ``--lora-modules``, the adapter's name as ``model``, ``/v1/models`` with
``parent``, ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, and clear 4xx answers that load nothing.

Most tests run on a simulated worker (the same HTTP server over the engine's own adapter registry, no weights);
one runs the official ``openai`` client against a real worker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fleet_helpers import sim_workers, smollm2_adapter

from fleetllm.server.worker_secret import ENV as SECRET_ENV


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/allowed/{a1,a2,spare}``: adapters at SmolLM2's shapes; ``root/outside/x``: one outside the roots."""
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("a1", "a2", "spare")):
        smollm2_adapter(root / "allowed" / name, seed=i)
    smollm2_adapter(root / "outside" / "x", seed=9)
    return root


@pytest.fixture(scope="module")
def url(adapters: Path) -> Iterator[str]:
    allowed = adapters / "allowed"
    s = sim_workers(1, "--enable-lora", "--max-loras", "2", "--lora-modules", f"a1={allowed / 'a1'}",
                    json.dumps({"name": "a2", "path": str(allowed / "a2"), "base_model_name": "smollm2-135m"}))
    yield s.url
    s.stop()


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 3})


def served(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]


def test_lora_modules_are_listed_as_models_with_their_parent(url: str, adapters: Path) -> None:
    cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert cards["a1"]["parent"] == cards["a2"]["parent"] == "smollm2-135m"
    assert cards["a1"]["root"] == str(adapters / "allowed" / "a1")
    assert "parent" not in cards["smollm2-135m"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_naming_an_adapter_is_answered_under_its_name(url: str, path: str) -> None:
    body = {"model": "a1", "max_tokens": 3, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(url + path, json=body)
    assert r.status_code == 200 and r.json()["model"] == "a1"


def test_a_model_that_is_neither_the_base_nor_an_adapter_is_a_404_naming_both(url: str) -> None:
    r = complete(url, "a9")
    assert r.status_code == 404
    assert "smollm2-135m" in r.json()["error"]["message"] and "a1" in r.json()["error"]["message"]


def test_a_loaded_adapter_serves_and_after_its_unload_is_a_404(url: str, adapters: Path) -> None:
    path = str(adapters / "allowed" / "spare")
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": path}).status_code == 200
    assert complete(url, "hot").status_code == 200
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 200
    assert complete(url, "hot").status_code == 404
    assert "hot" not in served(url)


def test_a_path_outside_the_allowed_roots_is_refused_by_name_and_nothing_loads(url: str, adapters: Path) -> None:
    outside = str(adapters / "outside" / "x")
    sneaky = str(adapters / "allowed" / ".." / "outside" / "x")  # .. resolved before the roots are compared
    for path in (outside, sneaky):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": path})
        assert r.status_code == 403 and "allowed roots" in r.json()["error"]["message"]
    assert "evil" not in served(url)
    assert complete(url, "a1").status_code == 200  # the worker is unharmed


@pytest.mark.parametrize(("body", "status"), [
    ({"lora_name": "a1", "lora_path": "/tmp"}, 400),  # already loaded
    ({"lora_name": "smollm2-135m", "lora_path": "/tmp"}, 400),  # the base model's name
    ({"lora_path": "/tmp"}, 400),
    ({"lora_name": "x", "lora_path": "ftp://host/adapter"}, 400),
])
def test_malformed_loads_are_400s(url: str, body: dict, status: int) -> None:
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == status


def test_an_adapter_that_does_not_fit_the_model_is_a_400_and_nothing_loads(url: str, adapters: Path) -> None:
    bad = adapters / "allowed" / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 512, "lora_alpha": 8,
                                                         "target_modules": ["q_proj"]}))
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "bad" not in served(url)


def test_unloading_an_unknown_adapter_is_a_404(url: str) -> None:
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "never"}).status_code == 404


def test_requests_are_counted_per_adapter_and_reported_as_vllm_does(url: str) -> None:
    assert complete(url, "a2").status_code == 200
    text = httpx.get(url + "/metrics").text
    assert 'lora_name="a2"' in text
    assert "vllm:lora_requests_info{" in text and 'max_lora="2"' in text


def test_requests_in_flight_are_reported_per_adapter_for_the_autoscaler() -> None:
    from types import SimpleNamespace as NS

    from prometheus_client import CollectorRegistry

    from fleetllm.server.lora_metrics import LoraInfo

    def seqs(*names: str | None) -> list[NS]:
        return [NS(lora_name=n) for n in names]

    engine = NS(scheduler=NS(running=seqs("a1", "a1", None), waiting=seqs("a2", "a1", None)), lora=NS(max_loras=2),
                metrics=NS(labels={"model_name": "m"}))
    r = CollectorRegistry()
    r.register(LoraInfo(engine))
    counts = {n: r.get_sample_value("fleetllm:lora_requests_in_flight", {"model_name": "m", "lora_name": n})
              for n in ("a1", "a2", "")}
    assert counts == {"a1": 3, "a2": 1, "": None}  # running and waiting alike; base-model requests are not an adapter's


def test_with_a_fleet_secret_only_the_secret_loads_adapters(adapters: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "fleet-secret")
    s = sim_workers(1, "--enable-lora", "--api-key", "client-key")
    try:
        body = {"lora_name": "s", "lora_path": str(adapters / "outside" / "x")}
        client = httpx.post(s.url + "/v1/load_lora_adapter", json=body, headers={"authorization": "Bearer client-key"})
        fleet = httpx.post(s.url + "/v1/load_lora_adapter", json=body,
                           headers={"authorization": "Bearer fleet-secret"})
    finally:
        s.stop()
    assert client.status_code == 401
    assert fleet.status_code == 403  # past the door; then its path is checked (no --lora-modules: the cache only)


def test_the_openai_client_runs_an_adapter_on_a_real_worker(worker_factory, adapters: Path) -> None:  # noqa: ANN001
    openai = pytest.importorskip("openai")
    w = worker_factory("--enable-lora", "--lora-modules", f"a1={adapters / 'allowed' / 'a1'}", "--num-blocks", "32")
    client = openai.OpenAI(base_url=w.openai_base_url, api_key="unused")
    assert "a1" in [m.id for m in client.models.list().data]
    r = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4)
    assert r.model == "a1" and r.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
