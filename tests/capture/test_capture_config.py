"""Capture settings: one definition, read from the fleet YAML and the flags alike; payload limits and hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetllm.capture.config import CaptureConfig
from fleetllm.capture.recorder import Capture
from fleetllm.capture.sampling import sample_point, sampled
from fleetllm.cli import build_parser
from fleetllm.cli_options import from_args, to_argv
from fleetllm.fleet.config import FleetConfig
from fleetllm.fleet.launcher import Fleet


def test_the_yaml_block_reaches_the_router_and_every_worker_as_flags(tmp_path: Path):
    cfg = FleetConfig.from_dict({"models": [{"source": "smollm2-135m", "simulate": True, "replicas": 2}],
                                 "log_dir": str(tmp_path),
                                 "capture": {"destination": "s3://b/p", "sampling": 10, "tiers": ["endpoint", "worker"],
                                             "kms_key_id": "k", "envelope": True}})
    fleet = Fleet(cfg)
    for proc in [fleet.router, *fleet.workers]:
        cmd = proc.cmd[proc.cmd.index("router" if proc is fleet.router else "worker"):]
        args = build_parser().parse_args(cmd)
        assert from_args(CaptureConfig, args) == cfg.capture
    assert cfg.capture.percent("access") == 10.0


def test_flags_round_trip_and_unknown_tiers_are_refused():
    cfg = CaptureConfig(destination="/tmp/c", sampling={"endpoint": "5"}, redact=["a+b"], max_age_s=60.0)
    args = build_parser().parse_args(["router", "--workers", "http://w:1", *to_argv(cfg)])
    assert from_args(CaptureConfig, args) == cfg
    with pytest.raises(ValueError, match="unknown capture tiers"):
        CaptureConfig(tiers=["gateway"])
    with pytest.raises(ValueError, match="kms_key_id"):
        CaptureConfig(envelope=True)


def test_sampling_is_a_pure_function_of_the_id():
    ids = [f"req-{i}" for i in range(2000)]
    assert all(sampled(i, 20) for i in ids if sampled(i, 10))  # 20 % keeps a superset of 10 %
    assert 150 <= sum(sampled(i, 10) for i in ids) <= 250
    assert sample_point("abc") == sample_point("abc") and not sampled("abc", 0) and sampled("abc", 100)


def drop_secrets(tier: str, record: dict) -> dict | None:
    return None if "drop me" in json.dumps(record) else record


@pytest.mark.parametrize("oversize", ["truncate", "skip"])
def test_a_payload_over_the_limit_is_truncated_with_a_marker_or_skipped(tmp_path: Path, oversize: str):
    cap = Capture(CaptureConfig(destination=str(tmp_path), max_payload_kb=1, oversize=oversize), "w", ("worker",))
    flags: set[str] = set()
    text = cap.payload("worker", "x" * 5000, flags)
    if oversize == "skip":
        assert text is None
    else:
        assert text.startswith("x" * 1024) and text.endswith("[truncated by fleetllm capture: 5000 bytes]")
        assert flags == {"truncated"}


def test_the_redaction_hook_sees_the_whole_record_and_may_drop_it(tmp_path: Path):
    cfg = CaptureConfig(destination=str(tmp_path), redact_hook=f"{__name__}:drop_secrets")
    cap = Capture(cfg, "w", ("worker",))
    assert cap.write("worker", {"request_id": "a", "prompt": "fine"})
    assert not cap.write("worker", {"request_id": "b", "prompt": "drop me"})
