"""The state file a running ``fleetllm serve`` leaves for ``fleetllm fleet`` commands run from another shell.

One JSON file per fleet, ``<run dir>/serve-<router port>.json``: the serve's pid, its router's URL and
log dir, and a count of finished rolling restarts with the last one's outcome. Keyed by the router's
port because no two fleets on one machine can share it. The serve writes it once ready, rewrites it
(atomically: write then rename) after each rolling restart, and removes it when it stops; a file whose
pid is gone is stale (a serve that was SIGKILLed) and is treated as no fleet.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from fleetllm.cli_options import opt


@dataclass
class RunDirOption:
    """Where ``fleetllm serve`` and ``fleetllm fleet`` meet."""

    run_dir: str | None = opt(None, "where `fleetllm serve` leaves its state file for `fleetllm fleet` commands "
                                    "(default: $XDG_RUNTIME_DIR/fleetllm, else a fleetllm-UID dir in the temp dir)")


@dataclass
class RunState:
    """What a running serve tells other shells."""

    pid: int
    url: str  # the router's base URL
    log_dir: str
    rolls: int = 0  # rolling restarts finished (successfully or not)
    roll_error: str = ""  # why the last one stopped ("" when it went through)


def run_dir(given: str | None = None) -> Path:
    """The run dir: ``given``, else the user's runtime dir, else one per user in the temp dir."""
    if given:
        return Path(given)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "fleetllm" if runtime else Path(tempfile.gettempdir()) / f"fleetllm-{os.getuid()}"


def state_path(port: int, given_dir: str | None = None) -> Path:
    return run_dir(given_dir) / f"serve-{port}.json"


def write(path: Path, state: RunState) -> None:
    """Replace the file at once: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, path)


def read(path: Path) -> RunState | None:
    """The state of the serve at ``path``; None when there is none, or its process is gone."""
    try:
        state = RunState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's: the caller's signal will say so
    return state
