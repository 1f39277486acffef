"""Placement: which machine (and which of its cores) runs each copy of each model.

First fit by free cores, memory and accelerators, spread across zones: each copy of a model goes to the
zone (among the model's ``zones``, else all zones) holding the fewest copies of that model so far, and there
to the first machine, in config order, with room. A copy that asks for ``cores`` gets that many cores of its
own (the launcher pins the worker to them); ``cores: None`` shares whatever the machine's unreserved cores
are, evenly among the copies sharing them. A plan that does not fit raises :class:`PlacementError` naming
the copy and what every machine has left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil

from fleetllm.fleet.config import FleetConfig, Machine, ModelSpec

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class PlacementError(ValueError):
    pass


@dataclass
class Slot:
    """What is left on one machine while copies are placed."""

    machine: Machine
    cores: list[int]  # unreserved core ids (this host's CPU numbers for a local machine)
    memory_gb: float
    accelerators: int
    copies: dict[str, int] = field(default_factory=dict)  # served name -> copies placed here

    def fits(self, m: ModelSpec) -> bool:
        r = m.resources
        return (len(self.cores) >= (r.cores or 0) and self.memory_gb >= r.memory_gb
                and self.accelerators >= r.accelerators)

    def describe(self) -> str:
        return (f"{self.machine.name} ({self.machine.zone}): {len(self.cores)} cores, "
                f"{self.memory_gb:.1f} GiB, {self.accelerators} accelerators free")


@dataclass
class Copy:
    """One copy of a model on a machine: its own cores (pinned), or a share of the unreserved ones."""

    model: ModelSpec
    index: int  # 0.. within its model
    machine: Machine
    cpus: list[int] | None  # reserved core ids; None: shares the machine's unreserved cores
    threads: int = 1

    @property
    def zone(self) -> str:
        return self.machine.zone


class Placer:
    """The free resources of a fleet's machines, taken by copies as they are placed and given back."""

    def __init__(self, machines: list[Machine]) -> None:
        self.slots = _slots(machines)

    def add(self, m: ModelSpec) -> Copy:
        """Place one more copy of ``m`` (raises :class:`PlacementError` naming what every machine has free)."""
        slot = _choose(self.slots, m)
        if slot is None:
            raise PlacementError(
                f"model {m.served_name!r}: a copy needs {m.resources.cores or 0} cores, {m.resources.memory_gb:.1f} "
                f"GiB and {m.resources.accelerators} accelerators{' in zones ' + ', '.join(m.zones) if m.zones else ''}"
                "; free: " + "; ".join(s.describe() for s in self.slots))
        n = m.resources.cores or 0
        cpus, slot.cores = (slot.cores[:n], slot.cores[n:]) if n else (None, slot.cores)
        slot.memory_gb -= m.resources.memory_gb
        slot.accelerators -= m.resources.accelerators
        slot.copies[m.unit] = slot.copies.get(m.unit, 0) + 1
        return Copy(m, slot.copies[m.unit] - 1, slot.machine, cpus, threads=n or 1)

    def release(self, c: Copy) -> None:
        slot = next(s for s in self.slots if s.machine is c.machine)
        slot.cores = sorted(slot.cores + (c.cpus or []))
        slot.memory_gb += c.model.resources.memory_gb
        slot.accelerators += c.model.resources.accelerators
        slot.copies[c.model.unit] -= 1


def place(cfg: FleetConfig, placer: Placer | None = None) -> list[Copy]:
    """Every model's ``initial`` copies placed onto ``cfg.machines`` (raises :class:`PlacementError`)."""
    placer = placer or Placer(cfg.machines)
    copies = []
    for m in cfg.models:
        for i in range(m.replicas.initial):
            try:
                copies.append(placer.add(m))
            except PlacementError as e:
                raise PlacementError(f"copy {i + 1} of {m.replicas.initial}: {e}") from None
    _share_cores(copies, placer.slots)
    return copies


def _slots(machines: list[Machine]) -> list[Slot]:
    """Free resources per machine. Local machines are consecutive slices of this host's CPUs."""
    host_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    mem = psutil.virtual_memory().total / 2**30
    local = [m for m in machines if m.host in LOCAL_HOSTS]
    declared = sum(m.cores or len(host_cpus) for m in local)
    slots, offset = [], 0
    for m in machines:
        n = m.cores or len(host_cpus)
        if m.host in LOCAL_HOSTS and declared <= len(host_cpus):
            cpus = host_cpus[offset:offset + n]  # real CPU numbers: copies on this machine can be pinned
            offset += n
        else:
            cpus = [-1 - k for k in range(n)]  # more declared than this host has: counted, never pinned
        slots.append(Slot(m, cpus, m.memory_gb if m.memory_gb is not None else mem, m.accelerators))
    return slots


def _choose(slots: list[Slot], m: ModelSpec) -> Slot | None:
    zones = m.zones or list(dict.fromkeys(s.machine.zone for s in slots))
    placed = {z: sum(s.copies.get(m.unit, 0) for s in slots if s.machine.zone == z) for z in zones}
    for zone in sorted(zones, key=lambda z: placed[z]):  # stable: config order among equals
        for s in slots:
            if s.machine.zone == zone and s.fits(m):
                return s
    return None


def _share_cores(copies: list[Copy], slots: list[Slot]) -> None:
    """Copies without reserved cores split what their machine has left, at least one thread each."""
    for s in slots:
        sharing = [c for c in copies if c.machine is s.machine and c.cpus is None and not c.model.simulate]
        for c in sharing:
            c.threads = max(1, len(s.cores) // len(sharing))
    for c in copies:
        if c.cpus is not None and c.cpus[0] < 0:
            c.cpus = None  # over-declared machine: no real CPUs to pin to
