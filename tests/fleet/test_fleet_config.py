"""The fleet YAML's `models:` schema and the placement of model copies onto machines."""

from __future__ import annotations

import json
import os

import pytest

from fleetllm.errors import UsageError
from fleetllm.fleet.config import FleetConfig, Replicas
from fleetllm.fleet.launcher import Fleet
from fleetllm.fleet.placement import PlacementError, place

TWO_ZONES = [{"name": "a", "cores": 2, "memory_gb": 8, "zone": "zone-a"},
             {"name": "b", "cores": 2, "memory_gb": 8, "zone": "zone-b"}]


def fleet(models: list[dict], machines: list[dict] | None = None, **kw) -> FleetConfig:
    d = {"models": models, **kw}
    if machines is not None:
        d["machines"] = machines
    return FleetConfig.from_dict(d)


def test_the_smallest_config_is_one_copy_of_the_embedded_model():
    cfg = FleetConfig.from_dict({})
    [m] = cfg.models
    assert (m.source, m.served_name, m.replicas.initial) == ("smollm2-135m", "smollm2-135m", 1)


def test_unknown_keys_are_refused_by_name_at_every_level():
    for bad, word in [({"modles": []}, "modles"), ({"models": [{"sorce": "x"}]}, "sorce"),
                      ({"models": [{"replicas": {"minimum": 1}}]}, "minimum"),
                      ({"models": [{"resources": {"gpus": 1}}]}, "gpus"),
                      ({"machines": [{"cpus": 4}]}, "cpus")]:
        with pytest.raises(ValueError, match=word):
            FleetConfig.from_dict(bad)


def test_replicas_take_a_count_or_min_max_initial_and_check_their_order():
    cfg = fleet([{"source": "a", "replicas": 3}, {"source": "b", "replicas": {"min": 0, "max": 4}}])
    assert (cfg.models[0].replicas.min, cfg.models[0].replicas.max) == (3, 3)
    assert (cfg.models[1].replicas.initial, cfg.models[1].replicas.max) == (1, 4)
    with pytest.raises(ValueError, match="min <= initial <= max"):
        Replicas(min=2, max=1)


def test_a_name_or_alias_used_by_two_models_is_refused():
    with pytest.raises(ValueError, match="'x' is used by two models"):
        fleet([{"source": "a", "name": "x"}, {"source": "b", "aliases": ["x"]}])


def test_engine_settings_become_worker_flags():
    [m] = fleet([{"source": "s", "engine": {"max_num_seqs": 8, "no_prefix_caching": True}, "speculative": "method=ngram"}]).models
    assert m.worker_args() == ["--max-num-seqs", "8", "--no-prefix-caching", "--speculative", "method=ngram"]


def test_copies_spread_across_zones_and_reserve_their_cores():
    cfg = fleet([{"source": "s", "replicas": 4, "resources": {"cores": 1, "memory_gb": 1}}], TWO_ZONES)
    copies = place(cfg)
    assert [c.zone for c in copies] == ["zone-a", "zone-b", "zone-a", "zone-b"]
    assert all(c.threads == 1 for c in copies)
    assert all(c.cpus is None for c in copies)  # 4 cores declared on this smaller host: counted, not pinned


def test_local_machines_are_slices_of_this_hosts_cpus_and_copies_are_pinned_to_them():
    host = sorted(os.sched_getaffinity(0))
    if len(host) < 2:
        pytest.skip("needs 2 CPUs")
    machines = [{"name": "a", "cores": 1, "zone": "zone-a"}, {"name": "b", "cores": 1, "zone": "zone-b"}]
    copies = place(fleet([{"source": "s", "replicas": 2, "resources": {"cores": 1}}], machines))
    assert [c.cpus for c in copies] == [[host[0]], [host[1]]]


def test_a_model_stays_in_its_zones():
    cfg = fleet([{"source": "s", "replicas": 2, "zones": ["zone-b"], "resources": {"cores": 1}}], TWO_ZONES)
    assert {c.machine.name for c in place(cfg)} == {"b"}


def test_a_plan_that_cannot_fit_is_refused_saying_what_is_free():
    cfg = fleet([{"source": "big", "replicas": 3, "resources": {"cores": 2, "memory_gb": 4}}], TWO_ZONES)
    with pytest.raises(PlacementError) as e:
        place(cfg)
    msg = str(e.value)
    assert "copy 3 of 3: model 'big': a copy needs 2 cores, 4.0 GiB" in msg
    assert "a (zone-a): 0 cores, 4.0 GiB" in msg and "b (zone-b): 0 cores, 4.0 GiB" in msg


def test_memory_and_accelerators_are_placement_constraints_too():
    machines = [{"name": "cpu", "cores": 4, "memory_gb": 64}, {"name": "gpu", "cores": 4, "memory_gb": 8, "accelerators": 1}]
    cfg = fleet([{"source": "s", "replicas": 1, "resources": {"memory_gb": 6, "accelerators": 1}}], machines)
    assert place(cfg)[0].machine.name == "gpu"
    with pytest.raises(PlacementError, match="1 accelerators"):
        place(fleet([{"source": "s", "replicas": 2, "resources": {"accelerators": 1}}], machines))


def test_copies_without_reserved_cores_share_what_is_left():
    cfg = fleet([{"source": "s", "replicas": 1, "resources": {"cores": 1}}, {"source": "t", "replicas": 3}],
                [{"name": "m", "cores": 4, "memory_gb": 32}])
    threads = [c.threads for c in place(cfg)]
    assert threads == [1, 1, 1, 1]  # 3 cores left for 3 sharing copies


def test_a_two_model_plan_gives_each_worker_its_model_and_the_router_every_tokenizer(tmp_path):
    cfg = fleet([{"source": "smollm2-135m", "name": "small", "aliases": ["s"], "replicas": 2, "policy": "session"},
                 {"source": "gemma3-270m", "name": "gemma", "replicas": 1, "engine": {"max_num_seqs": 8}}],
                port=9000, log_dir=str(tmp_path))
    f = Fleet(cfg)
    served = [p.cmd[p.cmd.index("--served-model-name") + 1] for p in f.workers]
    assert served == ["small", "small", "gemma"]
    assert f.workers[2].cmd[f.workers[2].cmd.index("--max-num-seqs") + 1] == "8"
    rcmd = f.router.cmd
    toks = [rcmd[i + 1] for i, a in enumerate(rcmd) if a == "--tokenizer"]
    assert toks == ["small=smollm2-135m", "gemma=gemma3-270m"]
    assert rcmd[rcmd.index("--alias") + 1] == "s=small"
    assert rcmd[rcmd.index("--model-policy") + 1] == "small=session"
    assert f.worker_urls == [f"http://127.0.0.1:{9001 + i}" for i in range(3)]


def test_simulated_copies_of_a_model_share_processes_per_zone(tmp_path):
    cfg = fleet([{"source": "smollm2-135m", "simulate": True, "replicas": 4}], TWO_ZONES, log_dir=str(tmp_path))
    f = Fleet(cfg)
    assert [len(p.urls) for p in f.workers] == [2, 2]
    assert f.zones == ["zone-a", "zone-a", "zone-b", "zone-b"]


def test_variants_of_one_model_are_placed_apart_and_the_router_gets_their_split(tmp_path):
    cfg = fleet([{"source": "smollm2-135m", "name": "m", "variant": "stable", "traffic": 95, "replicas": 2},
                 {"source": "smollm2-135m", "name": "m", "variant": "canary", "traffic": 5, "replicas": 1}],
                port=9000, log_dir=str(tmp_path))
    assert [m.unit for m in cfg.models] == ["m@stable", "m@canary"]
    f = Fleet(cfg)
    rcmd = f.router.cmd
    assert rcmd[rcmd.index("--worker-variants") + 1] == "stable,stable,canary"
    assert rcmd[rcmd.index("--traffic") + 1] == "m=stable:95,canary:5"
    assert [len(f.procs_of(m)) for m in cfg.models] == [2, 1]


def test_a_model_listed_twice_needs_a_variant_on_every_entry_and_a_positive_weight():
    one = {"source": "smollm2-135m", "name": "m"}
    with pytest.raises(ValueError, match="listed twice"):
        fleet([one, one])
    with pytest.raises(ValueError, match="every entry names its `variant`"):
        fleet([{**one, "variant": "a"}, {**one, "role": "prefill"}])
    with pytest.raises(ValueError, match="one positive"):
        fleet([{**one, "variant": "a", "traffic": 0}, {**one, "variant": "b", "traffic": 0}])


def test_a_traffic_split_is_a_stable_weighted_choice_among_the_variants_that_are_up():
    from fleetllm.router.traffic import TrafficSplit, parse_weights

    split = TrafficSplit({"m": parse_weights("stable:3,canary:1")})
    picks = [split.choose("m", f"user-{i}", {"stable", "canary"}) for i in range(4000)]
    assert 800 <= picks.count("canary") <= 1200  # 1000 expected, sd 27
    assert picks == [split.choose("m", f"user-{i}", {"stable", "canary"}) for i in range(4000)]
    assert {split.choose("m", f"user-{i}", {"stable"}) for i in range(50)} == {"stable"}  # canary down
    assert split.choose("m", "u", set()) is None and split.choose("other", "u", {"stable"}) is None
    for bad in ("stable", "stable:x", "a:-1", "a:0"):
        with pytest.raises(ValueError):
            parse_weights(bad)


def test_serve_flags_for_keys_shared_state_and_scheduling_override_the_yaml_and_reach_router_and_workers(tmp_path):
    from fleetllm.cli import build_parser, fleet_config

    yaml_path = tmp_path / "fleet.yaml"
    yaml_path.write_text("state_url: redis://127.0.0.1:1\nkeys_file: yaml-keys.yaml\n"
                         "models: [{source: smollm2-135m, engine: {scheduling_policy: priority}}]\n")
    base = ["serve", "--config", str(yaml_path), "--log-dir", str(tmp_path)]

    def plan(*flags: str) -> Fleet:
        return Fleet(fleet_config(build_parser().parse_args([*base, *flags])))

    def flag(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    from_yaml = plan()
    assert flag(from_yaml.router.cmd, "--state-url") == "redis://127.0.0.1:1"
    assert flag(from_yaml.workers[0].cmd, "--scheduling-policy") == "priority"
    f = plan("--state-url", "redis://:pw@10.0.0.9:6380", "--keys-file", "flag-keys.yaml",
             "--scheduling-policy", "fcfs")
    assert flag(f.router.cmd, "--state-url") == "redis://:pw@10.0.0.9:6380"
    assert flag(f.router.cmd, "--keys-file") == "flag-keys.yaml"
    assert flag(f.workers[0].cmd, "--scheduling-policy") == "fcfs"


def test_serve_gives_its_router_a_batch_directory_under_the_fleets_log_directory(tmp_path):
    from fleetllm.cli import build_parser, fleet_config

    cmd = Fleet(fleet_config(build_parser().parse_args(["serve", "--simulate", "--log-dir", str(tmp_path)]))).router.cmd
    assert cmd[cmd.index("--batch-dir") + 1] == str(tmp_path / "batches")


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://", "127.0.0.1:6379"])
def test_a_state_url_that_is_not_a_redis_url_is_refused(url):
    with pytest.raises(ValueError, match="redis://HOST:PORT"):
        FleetConfig.from_dict({"state_url": url})


def test_a_models_adapters_reach_its_copies_as_lora_modules_and_the_router_as_routing_names(tmp_path):
    a1 = tmp_path / "a1"
    a1.mkdir()
    cfg = fleet([{"source": "smollm2-135m", "name": "small", "simulate": True, "engine": {"token_env": "SMALL_T"},
                  "adapters": [{"name": "support", "source": str(a1), "token_env": "SUPPORT_T"}]},
                 {"source": "smollm2-135m", "name": "other", "simulate": True, "engine": {"token_env": "OTHER_T"},
                  "adapters": [{"name": "sql", "source": str(a1)}]}], log_dir=str(tmp_path))
    f = Fleet(cfg)
    small, other = f.workers
    modules = small.cmd[small.cmd.index("--lora-modules") + 1:]
    assert "--enable-lora" in small.cmd
    assert json.loads(modules[0]) == {"name": "support", "path": str(a1), "token_env": "SUPPORT_T"}
    rcmd = f.router.cmd
    assert [rcmd[i + 1] for i, a in enumerate(rcmd) if a == "--adapter"] == ["support=small", "sql=other"]
    assert "SUPPORT_T" not in small.hide and set(other.hide) == {"SMALL_T", "SUPPORT_T"}  # tokens stay per source


@pytest.mark.parametrize(("adapters", "word"), [
    ([{"name": "a"}], "needs source"),
    ([{"name": "a", "source": "/x", "rev": 1}], "unknown key"),
    ([{"name": "m", "source": "/x"}], "already the model's"),
    ([{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}], "already the model's or another adapter's"),
    ([{"name": "a", "source": "hf://only-a-name"}], "hf://org/name"),
])
def test_bad_adapter_entries_are_refused_in_one_line(adapters, word):
    with pytest.raises(UsageError, match=word):
        fleet([{"name": "m", "adapters": adapters}])
