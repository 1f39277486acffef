"""``fleetllm fleet``: act on a running ``fleetllm serve`` from another shell.

    fleetllm fleet restart [--port 8000 | --config fleet.yaml] [--run-dir DIR]

``restart`` rolls a restart through the fleet's workers, one process at a time, as SIGHUP to the serve
does (it sends that signal: the serve's pid comes from its state file, :mod:`fleetllm.fleet.runfile`),
and waits until the roll is done; it exits 0 when every worker came back, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fleetllm.cli_options import add_options, opt
from fleetllm.errors import UsageError
from fleetllm.fleet import runfile


@dataclass
class FleetTarget:
    """Which running fleet a ``fleetllm fleet`` command acts on."""

    port: int | None = opt(None, "the fleet's router port (default: the one fleet running, or --config's port)")
    config: str | None = opt(None, "the fleet YAML the serve was started with (its port names the fleet)")
    timeout_s: float = opt(900.0, "seconds to wait for the rolling restart to finish")


def find(args: argparse.Namespace) -> tuple[Path, runfile.RunState]:
    """The state file and state of the fleet the flags name; a UsageError with the reason when there is none."""
    port = args.port
    if port is None and args.config:
        from fleetllm.fleet.config import FleetConfig

        port = FleetConfig.from_yaml(args.config).port
    if port is not None:
        path = runfile.state_path(port, args.run_dir)
        state = runfile.read(path)
        if state is None:
            raise UsageError(f"no fleetllm serve with its router on port {port} (no live {path}): start one, or "
                             "name the running fleet's --port")
        return path, state
    live = [(p, s) for p in sorted(runfile.run_dir(args.run_dir).glob("serve-*.json"))
            if (s := runfile.read(p)) is not None]
    if not live:
        raise UsageError(f"no fleetllm serve running (no live state file in {runfile.run_dir(args.run_dir)}; "
                         "--run-dir names another)")
    if len(live) > 1:
        raise UsageError(f"{len(live)} fleets running ({', '.join(s.url for _, s in live)}): name one with --port")
    return live[0]


def cmd_restart(args: argparse.Namespace) -> int:
    path, state = find(args)
    before = state.rolls
    os.kill(state.pid, signal.SIGHUP)
    print(f"rolling restart of the fleet at {state.url} (serve pid {state.pid}; progress in {state.log_dir}) ...",
          flush=True)
    end = time.monotonic() + args.timeout_s
    while time.monotonic() < end:
        now = runfile.read(path)
        if now is None:
            print("the fleet stopped during the restart", file=sys.stderr)
            return 1
        if now.rolls > before:
            if now.roll_error:
                print(f"rolling restart stopped: {now.roll_error}", file=sys.stderr)
                return 1
            print("rolling restart done: every worker is back and routed to", flush=True)
            return 0
        time.sleep(0.25)
    print(f"the rolling restart did not finish in {args.timeout_s:.0f}s (it goes on in the serve)", file=sys.stderr)
    return 1


def add_fleet_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fleet", help="act on a running `fleetllm serve`: rolling restart")
    fs = f.add_subparsers(dest="fleet_command", required=True)
    r = fs.add_parser("restart", help="restart every worker, one process at a time, with no failed request")
    add_options(r, FleetTarget)
    add_options(r, runfile.RunDirOption)
    r.set_defaults(func=cmd_restart)
