"""The node's cache: LRU eviction that spares revisions in use, checks on load that hash only what changed,
`fleetllm models ls|verify|rm`, and the quarantine of what verify finds damaged."""

from __future__ import annotations

import dataclasses
import json
import os

from store_helpers import rot

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


def test_bytes_changed_behind_the_filesystem_are_quarantined_by_verify_and_fetched_again_by_the_next_start(
        hub, hub_repos, store_cfg, capsys):
    """What the start's check cannot see (the inode, size and mtime all unchanged) is what `fleetllm models
    verify` is for: the damaged file leaves the model's files and its manifest, so the next start fetches it."""
    from fleetllm.cli import main

    store = ModelStore(store_cfg)
    fetched = store.fetch("hf://test/tiny")
    weights = fetched.path / "model.safetensors"
    rot(weights)
    assert store.fetch("hf://test/tiny").downloaded == []  # unseen by a start's check
    flags = ["--cache-dir", store_cfg.cache_dir, "--hf-endpoint", hub.endpoint]
    assert main(["models", "verify", "hf://test/tiny", *flags]) == 1
    assert "model.safetensors" in capsys.readouterr().out
    manifest = json.loads((fetched.path.parent / "manifest.json").read_text())
    assert "model.safetensors" not in manifest["files"] and "model.safetensors" in manifest["quarantined"]
    assert not weights.exists() and (fetched.path.parent / "quarantine" / "model.safetensors").exists()
    assert store.fetch("hf://test/tiny").downloaded == ["model.safetensors"]
    source = hub_repos["test/tiny"].commits[fetched.revision]["model.safetensors"]
    assert weights.read_bytes() == source.read_bytes()
    assert not (fetched.path.parent / "quarantine" / "model.safetensors").exists()
    fetched.release()


def test_an_offline_start_after_a_quarantine_refuses_naming_the_file(hub, store_cfg, capsys):
    from fleetllm.cli import main

    fetched = ModelStore(store_cfg).fetch("hf://test/tiny")
    rot(fetched.path / "config.json")
    flags = ["--cache-dir", store_cfg.cache_dir, "--hf-endpoint", hub.endpoint]
    assert main(["models", "verify", *flags]) == 1
    capsys.readouterr()
    assert main(["models", "pull", "hf://test/tiny", "--offline", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "set config.json aside" in err[0] and "--repair" in err[0], err
    fetched.release()


def test_verify_repair_fetches_a_damaged_file_again_now(hub, store_cfg, capsys):
    from fleetllm.cli import main

    store = ModelStore(store_cfg)
    fetched = store.fetch("hf://test/tiny")
    good = (fetched.path / "tokenizer.json").read_bytes()
    rot(fetched.path / "tokenizer.json")
    flags = ["--cache-dir", store_cfg.cache_dir, "--hf-endpoint", hub.endpoint]
    assert main(["models", "verify", "--repair", *flags]) == 0
    assert "tokenizer.json: fetched again" in capsys.readouterr().out
    assert (fetched.path / "tokenizer.json").read_bytes() == good
    assert store.fetch("hf://test/tiny").downloaded == []  # whole again: nothing left for a start to fetch
    assert main(["models", "verify", *flags]) == 0
    fetched.release()
