"""The node's cache: LRU eviction that spares revisions in use, checks on load that hash only what changed, and
`fleetllm models ls|verify|rm`."""

from __future__ import annotations

import dataclasses
import json
import os

import fleetllm.store.cache as cache_module
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


def test_a_start_hashes_only_the_cached_files_that_changed(hub, store_cfg, monkeypatch):
    store = ModelStore(store_cfg)
    fetched = store.fetch("hf://test/tiny")
    hashed = []
    real_check = cache_module.check
    monkeypatch.setattr(cache_module, "check", lambda path, expected: hashed.append(path.name) or real_check(path, expected))
    store.fetch("hf://test/tiny")
    assert hashed == []  # every file is still the one its manifest entry was verified from
    os.utime(fetched.path / "config.json")  # touched, not changed: hashed once, then trusted again
    assert store.fetch("hf://test/tiny").downloaded == [] and hashed == ["config.json"]
    store.fetch("hf://test/tiny")
    assert hashed == ["config.json"]
    fetched.release()


def test_bytes_changed_behind_the_filesystem_are_found_by_models_verify(hub, store_cfg, capsys):
    """What the start's check cannot see (the inode, size and mtime all unchanged, as after a media error) is
    what `fleetllm models verify` is for."""
    from fleetllm.cli import main

    store = ModelStore(store_cfg)
    fetched = store.fetch("hf://test/tiny")
    weights = fetched.path / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(100)
        f.write(b"\x00" * 8)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store.fetch("hf://test/tiny").downloaded == []
    flags = ["--cache-dir", store_cfg.cache_dir, "--hf-endpoint", hub.endpoint]
    assert main(["models", "verify", "hf://test/tiny", *flags]) == 1
    assert "model.safetensors" in capsys.readouterr().out
    manifest = json.loads((fetched.path.parent / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"]["mtime_ns"] == st.st_mtime_ns
    fetched.release()
