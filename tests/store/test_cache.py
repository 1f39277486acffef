"""The node's cache: LRU eviction that spares revisions in use, and `fleetllm models ls|verify|rm`."""

from __future__ import annotations

import dataclasses

from fleetllm.store.store import ModelStore


def test_least_recently_used_revisions_are_evicted_but_not_those_in_use(hub, hub_repos, store_cfg):
    store = ModelStore(store_cfg)
    c1, c2 = list(hub_repos["test/tiny"].commits)
    first = store.fetch(f"hf://test/tiny@{c1}")
    limited = ModelStore(dataclasses.replace(store_cfg, cache_max_gb=0.02))  # room for one 13 MB revision
    second = limited.fetch(f"hf://test/tiny@{c2}")
    assert first.path.exists()  # held by this process (its shared flock): kept over the limit
    first.release()  # the process serving it is gone
    limited.fetch(f"hf://test/tiny@{c2}")
    assert not first.path.exists() and second.path.exists()


def test_models_ls_verify_and_rm(hub, store_cfg, capsys):
    from fleetllm.cli import main

    flags = ["--cache-dir", store_cfg.cache_dir, "--hf-endpoint", hub.endpoint]
    assert main(["models", "pull", "hf://test/tiny", *flags]) == 0
    fetched = ModelStore(store_cfg).fetch("hf://test/tiny")
    assert main(["models", "ls", *flags]) == 0
    assert f"hf://test/tiny@{fetched.revision}" in capsys.readouterr().out
    with open(fetched.path / "tokenizer.json", "r+b") as f:
        f.write(b"[")
    assert main(["models", "verify", *flags]) == 1
    assert "tokenizer.json" in capsys.readouterr().out
    fetched.release()
    assert main(["models", "rm", "hf://test/tiny", *flags]) == 0
    assert not fetched.path.exists()
