"""Pinning a worker process to cores: ``fleetllm worker --cpus 0-1``.

A worker that shares cores with others is measured against whatever else runs there; pinned, two fleets
given the same cores get the same compute (the disaggregation benchmark compares them so). The pin is
taken before torch starts its thread pool, and the pool is then as large as the pinned set unless
``--num-threads`` says otherwise. Torch-free (the CLI imports it to build its flags).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fleetllm.cli_options import opt


@dataclass
class PinningOptions:
    """Which cores a worker process runs on."""

    cpus: str | None = opt(None, "pin the process to these cores, e.g. 0, 0-1 or 0,2-3 (os.sched_setaffinity at "
                                 "start); --num-threads then defaults to their count")


def parse_cpus(text: str) -> list[int]:
    """``[0, 2, 3]`` for ``"0,2-3"``: sorted, without repeats (``ValueError`` on anything else)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a core list: {text!r} (e.g. 0, 0-1 or 0,2-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a core list: {text!r} ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """The ``--cpus`` value for a list of cores: ``"0,1"``, which :func:`parse_cpus` reads back."""
    return ",".join(str(c) for c in sorted(cpus))


def pin_process(text: str) -> list[int]:
    """Pin this process (and the threads it starts from now on) to the cores of ``text``; returns them.

    Raises ``ValueError`` for a malformed list or cores this process may not use."""
    cpus = parse_cpus(text)
    allowed = os.sched_getaffinity(0)
    missing = [c for c in cpus if c not in allowed]
    if missing:
        raise ValueError(f"cores {format_cpus(missing)} are not available to this process "
                         f"(it may use {format_cpus(sorted(allowed))})")
    os.sched_setaffinity(0, cpus)
    return cpus
