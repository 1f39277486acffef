"""``fleetllm serve --kv-remote auto`` (or a fleet YAML's ``engine: {kv_remote: auto}``): the fleet starts one
private redis-server, shared with ``--state-url auto``, which every real worker gets as its shared KV tier and
which evicts the least recently used keys past its memory cap."""

from __future__ import annotations

import redis

from fleetllm.cli import build_parser, fleet_config
from fleetllm.fleet.launcher import Fleet, private_store
from fleetllm.router.state_url import AUTO


def test_kv_remote_auto_and_state_url_auto_share_one_private_redis_every_worker_is_given(tmp_path) -> None:
    args = build_parser().parse_args(["serve", "--replicas", "2", "--kv-remote", "auto", "--state-url", "auto",
                                      "--log-dir", str(tmp_path)])
    cfg = fleet_config(args)
    assert cfg.models[0].engine["kv_remote"] == AUTO
    store = private_store(cfg)
    try:
        assert store is not None and cfg.state_url == store.url == cfg.models[0].engine["kv_remote"]
        fleet = Fleet(cfg)
        for w in fleet.workers:
            assert w.cmd[w.cmd.index("--kv-remote") + 1] == store.url
        client = redis.Redis.from_url(store.url)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert int(client.config_get("maxmemory")["maxmemory"]) > 0
        client.close()
    finally:
        store.stop()


def test_a_fleet_yaml_asking_kv_remote_auto_alone_gets_a_store_and_a_fleet_asking_neither_none(tmp_path) -> None:
    yaml_path = tmp_path / "fleet.yaml"
    yaml_path.write_text("models: [{source: smollm2-135m, engine: {kv_remote: auto}}]\n")
    cfg = fleet_config(build_parser().parse_args(["serve", "--config", str(yaml_path)]))
    store = private_store(cfg)
    try:
        assert store is not None and cfg.models[0].engine["kv_remote"] == store.url and cfg.state_url is None
    finally:
        store.stop()
    assert private_store(fleet_config(build_parser().parse_args(["serve", "--replicas", "1"]))) is None
