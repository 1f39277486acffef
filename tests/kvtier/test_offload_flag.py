"""--kv-offload-gb, --kv-disk-dir/--kv-disk-gb and --kv-remote reach every real worker: from `fleetllm serve` and from the fleet YAML's engine:."""

from __future__ import annotations

from fleetllm.cli import build_parser, fleet_config


def test_serve_passes_the_host_tier_to_every_worker() -> None:
    argv = ["serve", "--prefill", "1", "--decode", "1", "--kv-offload-gb", "2", "--kv-offload-dtype", "fp8"]
    cfg = fleet_config(build_parser().parse_args(argv))
    for m in cfg.models:
        args = m.worker_args()
        assert args[args.index("--kv-offload-gb") + 1] == "2.0" and args[args.index("--kv-offload-dtype") + 1] == "fp8"
    assert len(cfg.models) == 2


def test_the_fleet_yamls_value_stands_unless_serve_gives_the_flag(tmp_path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("models:\n  - source: smollm2-135m\n    engine: {kv_offload_gb: 4}\n")
    parse = build_parser().parse_args
    assert fleet_config(parse(["serve", "--config", str(path)])).models[0].engine == {"kv_offload_gb": 4}
    given = fleet_config(parse(["serve", "--config", str(path), "--kv-offload-gb", "1"]))
    assert given.models[0].engine == {"kv_offload_gb": 1.0}


def test_serve_passes_the_disk_and_shared_tiers_to_every_real_worker() -> None:
    argv = ["serve", "--replicas", "2", "--kv-disk-dir", "/nvme/kv", "--kv-disk-gb", "50",
            "--kv-remote", "redis://10.0.0.5:6379"]
    cfg = fleet_config(build_parser().parse_args(argv))
    assert [m.engine for m in cfg.models] == [{"kv_disk_dir": "/nvme/kv", "kv_disk_gb": 50.0,
                                               "kv_remote": "redis://10.0.0.5:6379"}] * len(cfg.models)
