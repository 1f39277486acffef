"""The step-cost measure kept on disk, so that a worker that starts again on the same machine, model shape and code
does not spend its start-up timing steps again (a few seconds of CPU on a small CPU; every copy of a fleet, every
restart).

An entry is keyed by everything the timings depend on and nothing they do not: the CPU (model name and flags),
the thread count, the row counts, the model's shape and the classes of its modules (its quantisation and kernels'
paths, not its weights' values), the context the KV pool lets it measure and the pool's dtype, which C kernels are loaded (a measure taken while
they still built is another key), and the source of the code a step runs (``models/``, ``kernels/``, the runner
and this measure). Entries older than :data:`MAX_AGE` are measured again: a machine's neighbours change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fleetllm.engine.model_runner import ModelRunner
    from fleetllm.speculative.step_cost import StepCost

log = logging.getLogger(__name__)
MAX_AGE = 24 * 3600.0  # seconds an entry is used for
_PACKAGE = Path(__file__).resolve().parents[1]
_CODE = ("models", "kernels", "engine/model_runner.py", "speculative/step_cost.py", "lora/tables.py")


def key(runner: ModelRunner, max_rows: int) -> str:
    """The entry's name for a measure of ``runner``'s steps up to ``max_rows`` rows on this machine."""
    from fleetllm.kernels.health import libraries
    from fleetllm.kernels.variants import cpu_info
    from fleetllm.speculative.step_cost import context_for

    k = runner.kv_cache[0][0]
    parts: dict[str, Any] = {
        "cpu": cpu_info()[0], "flags": sorted(cpu_info()[1]), "threads": torch.get_num_threads(), "max_rows": max_rows,
        "cfg": repr(dataclasses.asdict(runner.model.cfg)) if dataclasses.is_dataclass(runner.model.cfg) else "",
        "modules": sorted({type(m).__qualname__ for m in runner.model.modules()}),
        "pool": [context_for(runner), str(k.dtype), runner.block_size],  # the pool matters by the context it holds
        "kernels": sorted(f"{n}:{lib.variant}" for n, lib in libraries().items() if lib.lib is not None),
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def load(name: str) -> StepCost | None:
    """The entry ``name`` if it exists and is younger than :data:`MAX_AGE`."""
    from fleetllm.speculative.step_cost import StepCost

    path = _path(name)
    try:
        if time.time() - path.stat().st_mtime > MAX_AGE:
            return None
        return StepCost(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # absent, unreadable or from another version of StepCost: measure again


def save(name: str, cost: StepCost) -> None:
    """Write the entry (atomically: a reader never sees half of it); a cache that cannot be written is skipped."""
    path = _path(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(cost)))
        tmp.replace(path)
    except OSError as e:
        log.info("step-cost measure not cached (%s)", e)


def _path(name: str) -> Path:
    from fleetllm.models.source import cache_dir

    return cache_dir() / "step-cost" / f"{name}.json"


_DIGEST: list[str] = []


def _code_digest() -> str:
    if not _DIGEST:
        h = hashlib.sha256()
        for part in _CODE:
            root = _PACKAGE / part
            for f in sorted(root.rglob("*") if root.is_dir() else [root]):
                if f.suffix in (".py", ".c", ".h"):
                    h.update(f.relative_to(_PACKAGE).as_posix().encode() + f.read_bytes())
        _DIGEST.append(h.hexdigest()[:16])
    return _DIGEST[0]
