"""Pinning a worker to cores: the --cpus list, the pin itself, and the fleet passing each copy its cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleetllm.fleet.config import FleetConfig
from fleetllm.fleet.launcher import Fleet
from fleetllm.server.pinning import format_cpus, parse_cpus, pin_process


def test_a_core_list_reads_single_cores_ranges_and_both():
    assert parse_cpus("0") == [0]
    assert parse_cpus("0-1") == [0, 1]
    assert parse_cpus("3,0-1,1") == [0, 1, 3]
    assert parse_cpus(format_cpus([2, 0])) == [0, 2]


@pytest.mark.parametrize("text", ["", "a", "1-", "2-1", "0,,1", "-1"])
def test_a_malformed_core_list_is_refused(text):
    with pytest.raises(ValueError):
        parse_cpus(text)


def test_pinning_restricts_the_process_to_its_cores():
    host = sorted(os.sched_getaffinity(0))
    code = (f"from fleetllm.server.pinning import pin_process; import os; pin_process('{host[-1]}'); "
            "print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([host[-1]])


def test_a_core_this_process_may_not_use_is_refused():
    with pytest.raises(ValueError, match="not available"):
        pin_process(str(max(os.sched_getaffinity(0)) + 1000))


def test_a_fleet_with_reserved_cores_passes_each_worker_its_own(tmp_path):
    host = sorted(os.sched_getaffinity(0))
    if len(host) < 2:
        pytest.skip("needs 2 CPUs")
    cfg = FleetConfig.single_model("smollm2-135m", 0, prefill=1, decode=1, cores=1)
    cfg.log_dir = str(tmp_path)
    f = Fleet(cfg)
    pins = [p.cmd[p.cmd.index("--cpus") + 1] for p in f.workers]
    threads = [p.cmd[p.cmd.index("--num-threads") + 1] for p in f.workers]
    assert pins == [str(host[0]), str(host[1])] and threads == ["1", "1"]
    assert [p.role for p in f.workers] == ["prefill", "decode"]
