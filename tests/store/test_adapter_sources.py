"""LoRA adapters from the model store: ``hf://`` and ``s3://`` adapters are pinned to a commit, checked and cached as
models are (their two PEFT files only), each with its own token, never the model's."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fleet_helpers import sim_workers, smollm2_adapter
from hub_server import HubRepo
from store_helpers import GATED_TOKEN

MODEL_TOKEN = "hf_MODELtoken-0d9e8f7a6b5c"  # the base model's token: no adapter source may ever see it


@pytest.fixture(scope="module")
def adapter_repos(hub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # noqa: ANN001
    """``test/lora`` (two commits: ``v1``, then ``main``), the gated ``test/lora-gated``, on the session's hub."""
    root = tmp_path_factory.mktemp("adapter-repos")
    commits = {}
    for i in (1, 2):
        d = Path(smollm2_adapter(root / f"c{i}", seed=i))
        (d / "README.md").write_text("# an adapter card the store must not fetch\n")
        commits[hashlib.sha1(f"lora|{i}".encode()).hexdigest()] = {p.name: p for p in d.iterdir()}
    c1, c2 = commits
    hub.state.repos["test/lora"] = HubRepo("test/lora", commits, {"v1": c1, "main": c2})
    hub.state.repos["test/lora-gated"] = HubRepo("test/lora-gated", {c1: commits[c1]}, {"main": c1},
                                                 token=GATED_TOKEN)
    return {"v1": c1, "main": c2}


@pytest.fixture
def worker(hub, adapter_repos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # noqa: ANN001
    """A simulated LoRA worker whose model has a token of its own, over a fresh cache, serving the gated adapter
    ``gated`` from its start with the adapter's own token."""
    monkeypatch.setenv("MODEL_HF_TOKEN", MODEL_TOKEN)
    monkeypatch.setenv("LORA_HF_TOKEN", GATED_TOKEN)
    gated = json.dumps({"name": "gated", "path": "hf://test/lora-gated", "token_env": "LORA_HF_TOKEN"})
    s = sim_workers(1, "--enable-lora", "--hf-endpoint", hub.endpoint, "--cache-dir", str(tmp_path / "cache"),
                    "--token-env", "MODEL_HF_TOKEN", "--lora-modules", gated)
    yield s.url
    s.stop()


def load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_a_hub_adapter_is_pinned_and_cached_with_its_two_files_only(worker, hub, adapter_repos, tmp_path) -> None:  # noqa: ANN001
    assert load(worker, "v1", "hf://test/lora@v1").status_code == 200
    card = next(m for m in httpx.get(worker + "/v1/models").json()["data"] if m["id"] == "v1")
    assert card["revision"] == adapter_repos["v1"] and card["root"] == "hf://test/lora@v1"
    files = tmp_path / "cache" / "hf--test--lora" / adapter_repos["v1"] / "files"
    assert sorted(p.name for p in files.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert hub.state.downloads[("test/lora", "README.md")] == 0


def test_a_gated_adapter_gets_its_own_token_and_never_the_models(worker, hub) -> None:  # noqa: ANN001
    assert "gated" in [m["id"] for m in httpx.get(worker + "/v1/models").json()["data"]]
    assert f"Bearer {GATED_TOKEN}" in hub.state.auth_headers
    assert load(worker, "no-token", "hf://test/lora-gated").status_code == 401  # the model's token is not its
    assert not any(MODEL_TOKEN in h for h in hub.state.auth_headers)


def test_an_adapter_from_s3_loads_through_the_store(s3_server, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    client = s3_server.client("s3")
    client.create_bucket(Bucket="fleetllm-adapters")
    for p in Path(smollm2_adapter(tmp_path / "src", seed=3)).iterdir():
        client.put_object(Bucket="fleetllm-adapters", Key=f"sql/{p.name}", Body=p.read_bytes(),
                          ChecksumAlgorithm="SHA256")
    s = sim_workers(1, "--enable-lora", "--s3-endpoint-url", s3_server.endpoint_url, "--cache-dir",
                    str(tmp_path / "cache"))
    try:
        assert load(s.url, "sql", "s3://fleetllm-adapters/sql").status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"model": "sql", "prompt": "SELECT", "max_tokens": 2})
    finally:
        s.stop()
    assert r.status_code == 200 and r.json()["model"] == "sql"
