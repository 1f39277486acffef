"""The Ray mode's settings: the ``ray:`` block and ``--ray``, and what each copy asks Ray for (no cluster needed)."""

from __future__ import annotations

import pytest

from fleetllm.cli import build_parser, fleet_config
from fleetllm.fleet.config import FleetConfig, RaySettings


def test_the_ray_block_is_an_address_or_a_mapping() -> None:
    assert FleetConfig.from_dict({"ray": "auto"}).ray == RaySettings(address="auto")
    cfg = FleetConfig.from_dict({"ray": {"address": "10.0.0.1:6379", "namespace": "prod", "strategy": "DEFAULT"}})
    assert cfg.ray == RaySettings(address="10.0.0.1:6379", namespace="prod", strategy="DEFAULT")
    assert FleetConfig.from_dict({}).ray is None
    with pytest.raises(ValueError, match="unknown key `ray.adress`; did you mean `address`"):
        FleetConfig.from_dict({"ray": {"adress": "auto"}})


def test_serve_ray_flag_sets_the_address_and_keeps_the_rest_of_the_block(tmp_path) -> None:
    (tmp_path / "fleet.yaml").write_text("ray: {address: auto, namespace: team-a}\n")
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "fleet.yaml"), "--ray", "127.0.0.2:6379"])
    assert fleet_config(args).ray == RaySettings(address="127.0.0.2:6379", namespace="team-a")
    assert fleet_config(build_parser().parse_args(["serve", "--simulate"])).ray is None


def test_each_copy_asks_ray_for_its_resources_and_is_spread_and_restarted() -> None:
    from fleetllm.fleet.ray_actor import actor_options

    cfg = FleetConfig.from_dict({"models": [{
        "source": "smollm2-135m", "replicas": 2, "zones": ["a", "b"],
        "resources": {"cores": 2, "memory_gb": 4, "accelerators": 1, "custom": {"instance:m7i": 1}}}]})
    m, ray_cfg = cfg.models[0], RaySettings()
    first, second = (actor_options(m, ray_cfg, f"fleetllm-worker:x:{i}", i, restart=True) for i in range(2))
    assert first["num_cpus"] == 2 and first["num_gpus"] == 1 and first["memory"] == 4 * 2**30
    assert first["resources"] == {"instance:m7i": 1}
    assert first["scheduling_strategy"] == "SPREAD" and first["max_restarts"] == -1
    assert (first["label_selector"], second["label_selector"]) == ({"zone": "a"}, {"zone": "b"})
    sim = FleetConfig.from_dict({"models": [{"source": "smollm2-135m", "simulate": True}]}).models[0]
    no_restart = actor_options(sim, ray_cfg, "n", 0, restart=False)
    assert no_restart["num_cpus"] == 0 and no_restart["max_restarts"] == 0 and "label_selector" not in no_restart


def test_the_router_of_a_ray_fleet_gets_the_cluster_not_a_worker_list(tmp_path) -> None:
    from fleetllm.fleet.ray_launcher import RayFleet

    cfg = FleetConfig.from_dict({"ray": {"address": "127.0.0.2:6379", "namespace": "ns"}, "log_dir": str(tmp_path),
                                 "models": [{"source": "smollm2-135m", "simulate": True, "replicas": 3}]})
    fleet = RayFleet(cfg)  # nothing runs until start()
    args = fleet.router.cmd
    assert args[args.index("--workers") + 1] == ""
    assert args[args.index("--ray-address") + 1] == "127.0.0.2:6379"
    assert args[args.index("--ray-namespace") + 1] == "ns"
    assert [p.name for p in fleet.workers] == [f"fleetllm-worker:smollm2-135m:{i}" for i in range(3)]
