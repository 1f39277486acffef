"""hf:// models through the official huggingface_hub client, against the hub-compatible server on 127.0.0.1."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hub_server import HubServer, HubState
from store_helpers import greedy

from fleetllm.models.loader import load_model
from fleetllm.store.config import StoreConfig
from fleetllm.store.store import ModelStore


@pytest.fixture(scope="module")
def hub_cfg(hub: HubServer, model_cache) -> StoreConfig:  # noqa: ANN001
    return StoreConfig(cache_dir=str(model_cache), hf_endpoint=hub.endpoint)


def test_greedy_output_from_a_hub_tag_equals_the_local_model(hub, hub_repos, hub_cfg, local_greedy):
    loaded = load_model("hf://test/smollm2@v1", store=hub_cfg)
    assert loaded.revision == hub_repos["test/smollm2"].branches["v1"]
    assert loaded.root == f"hf://test/smollm2@{loaded.revision}"
    assert set(loaded.phases) == {"resolve", "download", "verify", "load"}
    assert greedy(loaded) == local_greedy


def test_a_pinned_revision_holds_when_the_branch_moves(hub, hub_repos, store_cfg):
    store, repo = ModelStore(store_cfg), hub_repos["test/tiny"]
    first = store.fetch("hf://test/tiny@main")
    before = (first.path / "model.safetensors").read_bytes()
    second_commit = next(c for c in repo.commits if c != first.revision)
    hub.state.move_branch("test/tiny", "main", second_commit)
    try:
        asked = len(hub.state.requests)
        pinned = store.fetch(str(first.uri))  # what a running fleet's new copies are given
        assert pinned.revision == first.revision and (pinned.path / "model.safetensors").read_bytes() == before
        assert len(hub.state.requests) == asked  # a cached commit cannot change: the hub is not even asked
        moved = store.fetch("hf://test/tiny@main")  # a redeploy follows the branch
        assert moved.revision == second_commit and (moved.path / "model.safetensors").read_bytes() != before
    finally:
        hub.state.move_branch("test/tiny", "main", first.revision)


def test_only_the_files_the_loader_reads_are_fetched(hub, store_cfg):
    fetched = ModelStore(store_cfg).fetch("hf://test/tiny")
    assert sorted(fetched.downloaded) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_two_workers_pulling_together_download_once(hub, store_cfg):
    hub.state.throttle_bytes_per_s = 8e6  # 14.5 MB in ~2 s: both processes are inside the pull at once
    before = sum(n for (repo, _), n in hub.state.downloads.items() if repo == "test/tiny")
    cmd = [sys.executable, "-m", "fleetllm.cli", "models", "pull", "hf://test/tiny@main",
           "--cache-dir", store_cfg.cache_dir, "--hf-endpoint", hub.endpoint]
    try:
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        hub.state.throttle_bytes_per_s = None
    assert [p.returncode for p in procs] == [0, 0], outs
    after = sum(n for (repo, _), n in hub.state.downloads.items() if repo == "test/tiny")
    assert after - before == 4  # four files, each downloaded once
    assert sorted("downloaded 4 files" in o for o in outs) == [False, True], outs
    assert all("resolve" in o and "verify" in o for o in outs)


def test_a_corrupted_cached_file_is_detected_and_fetched_again(hub, store_cfg, caplog):
    store = ModelStore(store_cfg)
    first = store.fetch("hf://test/tiny")
    weights = first.path / "model.safetensors"
    good = weights.read_bytes()
    with open(weights, "r+b") as f:  # a bit rot of the same size
        f.seek(200)
        f.write(b"\xff" * 16)
    with caplog.at_level(logging.WARNING, logger="fleetllm"):
        again = store.fetch("hf://test/tiny")
    assert again.downloaded == ["model.safetensors"] and weights.read_bytes() == good
    assert "failed verification and was fetched again" in caplog.text


def test_with_the_hub_stopped_a_cached_model_still_starts(hub, hub_repos, model_cache, in_process_worker, caplog):
    own_hub = HubServer(HubState(hub.state.repos)).start()  # a hub this test may stop
    cfg = StoreConfig(cache_dir=str(model_cache), hf_endpoint=own_hub.endpoint)
    try:
        ModelStore(cfg).fetch("hf://test/smollm2")  # deployed once (cached by an earlier test, or now)
    finally:
        own_hub.stop()
    with caplog.at_level(logging.WARNING, logger="fleetllm"):
        loaded = load_model("hf://test/smollm2", store=cfg)
    commit = hub_repos["test/smollm2"].branches["main"]
    assert loaded.revision == commit and "from the local cache (offline)" in caplog.text
    worker = in_process_worker(loaded, "--num-blocks", "32")
    try:
        card = httpx.get(worker.url + "/v1/models").json()["data"][0]
        assert (card["root"], card["revision"]) == (f"hf://test/smollm2@{commit}", commit)
        r = httpx.post(worker.url + "/v1/completions", json={"model": card["id"], "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
        metrics = httpx.get(worker.url + "/metrics").text
        assert f'revision="{commit}"' in metrics and 'phase="verify"' in metrics and 'phase="download"' in metrics
    finally:
        worker.stop()


def test_a_gated_repo_without_a_token_fails_naming_the_model(hub, store_cfg, capsys):
    from fleetllm.cli import main

    rc = main(["worker", "--model", "hf://test/tiny-gated", "--cache-dir", store_cfg.cache_dir,
               "--hf-endpoint", hub.endpoint])
    assert rc == 2
    err = capsys.readouterr().err
    assert "fleetllm worker: error: cannot start: model hf://test/tiny-gated: the hub answered 401: the repository " \
           "is gated or private and give its token" in err
    assert "Traceback" not in err


def test_a_simulated_worker_takes_its_tokenizer_through_the_store_flags(hub, store_cfg):
    from fleetllm.models.tokenizer import TokenizerWrapper
    from fleetllm.sim.config import SimConfig
    from fleetllm.sim.server import build_workers

    (worker,) = build_workers("hf://test/tiny", 1, SimConfig(speed=1000.0), None, store=store_cfg)
    (files,) = Path(store_cfg.cache_dir).glob("hf--test--tiny/*/files")  # this test's own cache: the flag held
    assert sorted(p.name for p in files.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert worker.engine.tokenizer.encode("Hello") == TokenizerWrapper.from_hf_dir(files).encode("Hello")


def test_exporting_twice_into_one_directory_replaces_the_first(tmp_path) -> None:
    from fleetllm.models.export_hf import export_hf_dir

    first = export_hf_dir("smollm2-135m", tmp_path / "out")
    size = (first / "model.safetensors").stat().st_size
    assert export_hf_dir("smollm2-135m", tmp_path / "out") == first
    assert (first / "model.safetensors").stat().st_size == size and (first / "config.json").exists()
