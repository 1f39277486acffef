"""The CLI is generated from the config dataclasses: one definition per flag, its default and help."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from typing import Literal

import pytest

from fleetllm.cli import build_parser, sim_config
from fleetllm.cli_options import add_options, field_default, from_args, opt, to_argv
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.scheduler import SchedulerConfig
from fleetllm.fleet.config import FleetConfig
from fleetllm.fleet.launcher import Fleet
from fleetllm.router.config import RouterConfig
from fleetllm.server.config import ObservabilityConfig
from fleetllm.sim.config import SimConfig


@dataclasses.dataclass
class Knobs:
    url: str = opt(doc="required: no default")
    count: int = opt(3, "an int")
    ratio: float = opt(0.5, "a float")
    name: str | None = opt(None, "an optional str")
    mode: Literal["fast", "exact"] = opt("exact", "choices from a Literal")
    verbose: bool = opt(False, "a switch that turns on")
    cache: bool = opt(True, "a switch that turns off")
    hosts: list[str] = opt(doc="comma-separated", factory=list)
    aliases: dict[str, str] = opt(doc="KEY=VALUE, repeatable", factory=dict, flag="--alias")
    timeout_s: float = opt(2.0, "seconds")
    labels: dict[str, str] = opt(doc="set by code", factory=dict, cli=False)
    modules: list[str] = opt(doc="several values per flag, repeatable", factory=list, many=True)


def parser_for(*classes: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    for cls in classes:
        add_options(p, cls)
    return p


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_a_config_round_trips_through_its_flags() -> None:
    cfg = Knobs(url="http://x", count=7, ratio=0.25, name="n", mode="fast", verbose=True, cache=False,
                hosts=["a", "", "c"], aliases={"m": "ref", "k": "v=w"}, timeout_s=9.5, modules=["a=x", "b=y,z"])
    assert from_args(Knobs, parser_for(Knobs).parse_args(to_argv(cfg))) == cfg


def test_defaults_come_from_the_fields() -> None:
    assert from_args(Knobs, parser_for(Knobs).parse_args(["--url", "u"])) == Knobs(url="u")


def test_flags_are_named_and_typed_from_the_fields() -> None:
    args = parser_for(Knobs).parse_args(["--url", "u", "--count", "4", "--mode", "fast", "--no-cache",
                                         "--verbose", "--hosts", "a,b", "--alias", "x=1", "--alias", "y=2",
                                         "--timeout", "1"])
    assert (args.count, args.mode, args.cache, args.verbose) == (4, "fast", False, True)
    assert (args.hosts, args.aliases, args.timeout_s) == (["a", "b"], {"x": "1", "y": "2"}, 1.0)


@pytest.mark.parametrize("argv", [["--url", "u", "--mode", "slow"], ["--url", "u", "--count", "x"],
                                  ["--url", "u", "--alias", "novalue"], []])
def test_bad_values_and_missing_required_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parser_for(Knobs).parse_args(argv)


def test_a_field_marked_not_cli_is_no_flag() -> None:
    assert "--labels" not in parser_for(Knobs).format_help()
    assert "--metric-labels" not in subparser("worker").format_help()


def test_naming_a_field_that_is_no_flag_is_an_error() -> None:
    with pytest.raises(ValueError, match="labels"):
        add_options(argparse.ArgumentParser(), Knobs, only=["count", "labels"])


def test_a_new_field_becomes_a_flag_with_no_other_edit() -> None:
    @dataclasses.dataclass
    class Extended(EngineConfig):
        prefill_chunk: int = opt(256, "tokens of one prefill chunk")

    p = parser_for(Extended)
    assert "tokens of one prefill chunk (default: 256)" in " ".join(p.format_help().split())
    assert from_args(Extended, p.parse_args(["--prefill-chunk", "64"])).prefill_chunk == 64
    assert from_args(Extended, p.parse_args([])) == Extended()


@pytest.mark.parametrize("command", ["worker", "router", "serve", "generate"])
def test_every_generated_flag_has_help(command: str) -> None:
    for action in subparser(command)._actions:
        assert action.help, f"fleetllm {command} {action.option_strings} has no help"


@pytest.mark.parametrize(("command", "classes"), [
    ("worker", [EngineConfig, ObservabilityConfig]),
    ("router", [RouterConfig]),
    ("generate", [EngineConfig]),
])
def test_parser_defaults_agree_with_the_dataclasses(command: str, classes: list[type]) -> None:
    defaults = {a.dest: a.default for a in subparser(command)._actions}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name in defaults and not (command == "router" and f.name == "workers"):
                assert defaults[f.name] == field_default(f), (command, f.name)


def test_worker_flags_give_the_default_configs() -> None:
    args = parse("worker")
    assert from_args(EngineConfig, args) == EngineConfig()
    assert from_args(ObservabilityConfig, args) == ObservabilityConfig()
    assert (args.host, args.port, args.role) == ("127.0.0.1", 8001, "both")


def test_worker_flags_keep_their_names_and_meanings() -> None:
    args = parse("worker", "--no-prefix-caching", "--disable-log-requests", "--max-num-seqs", "8",
                 "--quantization", "int4", "--speculative", "method=ngram,k=4", "--otlp-interval", "2.5",
                 "--kv-cache-gb", "0.5")
    cfg, obs = from_args(EngineConfig, args), from_args(ObservabilityConfig, args)
    assert (cfg.enable_prefix_caching, cfg.max_num_seqs, cfg.quantization) == (False, 8, "int4")
    assert (cfg.speculative, cfg.kv_cache_gb) == ("method=ngram,k=4", 0.5)
    assert (obs.log_requests, obs.otlp_interval_s) == (False, 2.5)


def test_the_engine_scheduler_and_simulator_share_their_defaults() -> None:
    sched, eng, sim = SchedulerConfig(), EngineConfig(), SimConfig()
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
        assert getattr(sched, name) == getattr(eng, name) == getattr(sim, name), name


def test_the_simulated_worker_reads_the_engine_flags() -> None:
    cfg = sim_config(parse("worker", "--simulate", "--served-model-name", "m", "--max-num-seqs", "8",
                           "--no-prefix-caching", "--sim-speed", "4", "--num-blocks", "100"))
    assert cfg == SimConfig(model_name="m", max_num_seqs=8, enable_prefix_caching=False, speed=4.0,
                            num_blocks=100, block_size=EngineConfig.block_size)
    assert sim_config(parse("worker", "--simulate", "--max-model-len", "512")).max_model_len == 512


def test_router_flags_build_the_router_config() -> None:
    args = parse("router", "--workers", "http://a:1,http://b:2", "--zones", "z1,", "--roles",
                 "prefill,decode", "--tokenizer", "m=smollm2-135m", "--health-interval", "0.5",
                 "--breaker-cooldown", "2", "--pd-timeout", "30", "--policy", "least_load", "--seed", "3")
    cfg = from_args(RouterConfig, args)
    assert cfg == RouterConfig(workers=["http://a:1", "http://b:2"], zones=["z1", ""],
                               roles=["prefill", "decode"], tokenizers={"m": "smollm2-135m"},
                               health_interval_s=0.5, breaker_cooldown_s=2.0, pd_timeout_s=30.0,
                               policy="least_load", seed=3)


def test_pd_threshold_has_one_default() -> None:
    assert parse("router", "--workers", "u").pd_threshold == RouterConfig.pd_threshold == 4096
    assert parse("serve").pd_threshold is None  # the fleet config's, else the router's own
    assert "(default: 4096)" in " ".join(subparser("serve").format_help().split())


def test_every_command_line_the_fleet_launcher_writes_parses(tmp_path) -> None:
    cfg = FleetConfig.from_dict({
        "models": [{"source": "smollm2-135m", "name": "small", "aliases": ["s"], "role": "prefill",
                    "speculative": "method=ngram", "engine": {"max_num_seqs": 8, "no_prefix_caching": True},
                    "policy": "session"},
                   {"source": "smollm2-135m", "name": "sim", "simulate": True, "replicas": {"min": 0, "max": 2},
                    "engine": {"sim_speed": 2}}],
        "machines": [{"name": "z", "zone": "z"}], "keys_file": str(tmp_path / "keys.yaml"),
        "pd_threshold": 100, "otlp_endpoint": "http://127.0.0.1:4318", "log_dir": str(tmp_path)})
    fleet = Fleet(cfg)
    for proc in [*fleet.workers, fleet.router]:
        parse(*proc.cmd[3:])  # after `python -m fleetllm.cli`


def test_the_parsers_load_no_torch() -> None:
    code = ("import sys; from fleetllm.cli import build_parser; "
            "import fleetllm.router.gateway, fleetllm.sim.server; "
            "build_parser().parse_args(['worker', '--simulate']); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_many_valued_flag_takes_several_values_and_repeats_as_vllm_lora_modules() -> None:
    args = parse("worker", "--lora-modules", "a=/x", "b=/y", "--max-num-seqs", "4", "--lora-modules", "c=/z")
    assert args.lora_modules == ["a=/x", "b=/y", "c=/z"]
    assert parse("worker").lora_modules == []
