"""A fleet pins each hf:// source once, at deploy: every copy and the router get the same commit."""

from __future__ import annotations

from fleetllm.fleet.config import FleetConfig, ModelSpec
from fleetllm.fleet.launcher import Fleet


def test_a_fleet_pins_hub_sources_and_hides_other_models_tokens(hub, hub_repos, store_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("TINY_TOKEN", "hf_tiny-token")
    settings = {"hf_endpoint": hub.endpoint, "cache_dir": store_cfg.cache_dir, "token_env": "TINY_TOKEN"}
    cfg = FleetConfig(models=[ModelSpec(source="hf://test/tiny@main", name="tiny", engine=settings),
                              ModelSpec(source="smollm2-135m", name="chat", engine={"token_env": "CHAT_TOKEN"})],
                      log_dir=str(tmp_path))
    fleet = Fleet(cfg)  # plans the processes, starts none
    commit = hub_repos["test/tiny"].branches["main"]
    tiny, chat = (fleet.procs_of(m)[0] for m in cfg.models)
    assert tiny.cmd[tiny.cmd.index("--model") + 1] == f"hf://test/tiny@{commit}"
    tokenizer = next(a for a in fleet.router.cmd if a.startswith("tiny="))  # the router's: that commit's files
    assert tokenizer == f"tiny={store_cfg.cache_dir}/hf--test--tiny/{commit}/files"
    assert chat.cmd[chat.cmd.index("--model") + 1] == "smollm2-135m"
    assert (tiny.hide, chat.hide) == (["CHAT_TOKEN"], ["TINY_TOKEN"])
