"""A model's hub token: read from the file or variable its config names, sent to its hub, and nowhere else."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from store_helpers import GATED_TOKEN

from fleetllm.models.loader import load_model
from fleetllm.store.errors import StoreError
from fleetllm.store.secret import Secret, load_token
from fleetllm.store.store import ModelStore


def test_a_token_never_appears_in_any_log_metric_or_response(hub, store_cfg, in_process_worker, monkeypatch,
                                                              caplog, capsys):
    from fleetllm.cli import main

    monkeypatch.setenv("TINY_HF_TOKEN", GATED_TOKEN)
    cfg = dataclasses.replace(store_cfg, token_env="TINY_HF_TOKEN")
    caplog.set_level(logging.DEBUG)  # every logger: the hub client's and its HTTP library's too
    assert main(["models", "pull", "hf://test/tiny-gated", "--cache-dir", cfg.cache_dir, "--hf-endpoint",
                 hub.endpoint, "--token-env", "TINY_HF_TOKEN"]) == 0
    worker = in_process_worker(load_model("hf://test/tiny-gated", store=cfg), "--num-blocks", "16")
    try:
        u = worker.url
        answers = [httpx.get(u + "/v1/models"), httpx.get(u + "/metrics"), httpx.get(u + "/health"),
                   httpx.post(u + "/v1/completions", json={"model": "hf://test/tiny-gated", "prompt": "Hi",
                                                           "max_tokens": 2}),
                   httpx.post(u + "/v1/completions", json={"model": "hf://test/tiny-gated", "max_tokens": -1}),
                   httpx.get(u + "/no/such/route")]
        assert [r.status_code for r in answers] == [200, 200, 200, 200, 400, 404]
        log = worker.log()
    finally:
        worker.stop()
    monkeypatch.setenv("TINY_HF_TOKEN", "hf_a-wrong-token-0000")
    with pytest.raises(StoreError, match="its token is refused") as refused:
        ModelStore(dataclasses.replace(cfg, cache_dir=cfg.cache_dir + "-2")).fetch("hf://test/tiny-gated")
    cached = [p.read_text(errors="replace") for p in Path(cfg.cache_dir).rglob("*")  # manifests, refs, metadata
              if p.is_file() and p.stat().st_size < 1_000_000]
    everything = "\n".join([caplog.text, log, capsys.readouterr().out, str(refused.value), *cached,
                            *(r.text + str(r.headers) for r in answers)])
    assert f"Bearer {GATED_TOKEN}" in hub.state.auth_headers  # it did reach the hub: the grep means something
    assert GATED_TOKEN not in everything and "hf_a-wrong-token" not in everything


def test_a_model_without_a_token_sends_none(hub, store_cfg, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_a-users-own-token")  # huggingface_hub would send this by default
    sent = len(hub.state.requests)
    ModelStore(store_cfg).fetch("hf://test/tiny", weights=False)
    assert not any(had_token for _, _, had_token in hub.state.requests[sent:])


def test_a_token_comes_from_the_file_the_config_names(tmp_path, store_cfg):
    (tmp_path / "token").write_text(GATED_TOKEN + "\n")
    token = load_token(dataclasses.replace(store_cfg, token_file=str(tmp_path / "token")), "hf://o/m")
    assert token.reveal() == GATED_TOKEN and str(token) == repr(token) == "***" and f"{token}" == "***"
    with pytest.raises(StoreError, match="hf://o/m: cannot read its token file"):
        load_token(dataclasses.replace(store_cfg, token_file=str(tmp_path / "missing")), "hf://o/m")


def test_a_secret_cannot_be_pickled():
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(Secret(GATED_TOKEN))


@pytest.mark.slow
def test_a_worker_on_a_gated_repo_without_a_token_exits_2_naming_the_model(hub, store_cfg):
    """A real ``fleetllm worker`` process (its fetch runs on the thread that starts before its imports)."""
    cmd = [sys.executable, "-m", "fleetllm.cli", "worker", "--model", "hf://test/tiny-gated", "--cache-dir",
           store_cfg.cache_dir, "--hf-endpoint", hub.endpoint, "--host", "127.0.0.1", "--port", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "cannot start: model hf://test/tiny-gated: the hub answered 401" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
