"""Which adapters exist (by name), which are resident in the step's tables (``max_loras`` slots), which are kept in
memory behind them (``max_cpu_loras``, least recently used first out), and which are re-read from disk on demand.

A slot is pinned while a running request uses its adapter (:meth:`LoraManager.acquire` / :meth:`release`): the
scheduler acquires before a request's first step and releases when it finishes or is preempted, so the adapters of
one step never exceed ``max_loras`` and a resident adapter is never replaced under a running request. A slot no
request pins is evicted least recently used first when another adapter needs one.

Not thread-safe: the engine thread owns it (loads arrive through the async engine's command queue). Reading and
checking an adapter (:func:`fleetllm.lora.peft_format.read_adapter`) is pure and may run on any thread first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from fleetllm.lora.errors import LoraError, unknown_adapter
from fleetllm.lora.peft_format import Adapter, ModelSpec, read_adapter
from fleetllm.lora.tables import LoraTables


@dataclass
class _Entry:
    path: Path
    lora_id: int  # vLLM's ``lora_int_id``: stable for the name while it stays loaded
    slot: int = -1  # resident in this slot of the tables (-1: not resident)
    users: int = 0  # running requests pinning the slot


class LoraManager:
    """Adapter names -> slots of a :class:`LoraTables` (or bookkeeping only, ``tables`` None: a simulated worker)."""

    def __init__(self, spec: ModelSpec, tables: LoraTables | None, max_loras: int = 4, max_lora_rank: int = 64,
                 max_cpu_loras: int | None = None) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.spec, self.tables = spec, tables
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        self._entries: dict[str, _Entry] = {}
        self._cpu: OrderedDict[str, Adapter] = OrderedDict()  # kept in memory, least recently used first
        self._resident: OrderedDict[int, str] = OrderedDict()  # slot -> adapter, least recently used first
        self._retired: dict[int, _Entry] = {}  # slots of unloaded adapters still pinned by running requests
        self._ids = itertools.count(1)
        self.disk_reads = 0  # adapters read again from disk after leaving memory

    # ---- names ------------------------------------------------------------------------------------
    def read(self, path: str | Path) -> Adapter:
        """Read and check the adapter at ``path`` against this model and limits (no state changes; any thread)."""
        return read_adapter(path, self.spec, self.max_lora_rank)

    def load(self, name: str, path: str | Path, adapter: Adapter | None = None) -> None:
        """Make ``name`` an adapter of this model, read from ``path`` (or ``adapter``, read by :meth:`read`).
        Raises :class:`LoraError`: 400 when the name is taken or the adapter does not fit; nothing changes then."""
        if not name or name == self.spec.name:
            raise LoraError(f"`{name}` cannot name an adapter: it is empty or the base model's name")
        if name in self._entries:
            raise LoraError(f"the adapter `{name}` is already loaded; unload it first")
        adapter = adapter or self.read(path)
        self._entries[name] = _Entry(Path(path), next(self._ids))
        self._remember(name, adapter)

    def unload(self, name: str) -> None:
        """Forget ``name`` (404 if unknown). Requests already running with it finish with it; new ones get 404."""
        entry = self._entries.pop(name, None)
        if entry is None:
            raise unknown_adapter(name)
        self._cpu.pop(name, None)
        if entry.slot >= 0:
            del self._resident[entry.slot]
            if entry.users:
                self._retired[entry.slot] = entry
            else:
                self._clear(entry.slot)

    def names(self) -> list[str]:
        """The loaded adapters' names, in load order."""
        return list(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def path_of(self, name: str) -> Path:
        return self._known(name).path

    def lora_id(self, name: str) -> int:
        """The adapter's integer id (vLLM's ``lora_int_id``), 1-based."""
        return self._known(name).lora_id

    def resident(self) -> dict[str, int]:
        """Adapters in the tables now: name -> slot."""
        return {name: slot for slot, name in self._resident.items()}

    # ---- slots ------------------------------------------------------------------------------------
    def slot_for(self, name: str | None) -> int:
        """The slot ``name`` is resident in (-1 for the base model, or when not resident)."""
        return -1 if name is None else self._known(name).slot

    def can_acquire(self, name: str) -> bool:
        """Whether a request for ``name`` could run now: resident, or a slot free or held by no running request."""
        entry = self._known(name)
        return entry.slot >= 0 or self._free_slot() is not None

    def acquire(self, name: str) -> int:
        """Pin ``name``'s slot for one running request, making it resident first (from memory, else disk);
        returns the slot. Raises :class:`LoraError` when no slot can be had or the adapter cannot be read again."""
        entry = self._known(name)
        if entry.slot < 0:
            slot = self._free_slot()
            if slot is None:
                raise LoraError(f"all {self.max_loras} adapter slots are in use by running requests", status=503)
            self._place(name, entry, slot)
        entry.users += 1
        self._resident.move_to_end(entry.slot)
        return entry.slot

    def release(self, slot: int) -> None:
        """Unpin one running request's use of ``slot`` (a pinned slot is never reassigned, so the slot names the
        adapter, even one unloaded since: its slot is cleared when its last request lets go)."""
        retired = self._retired.get(slot)
        if retired is not None:
            retired.users -= 1
            if retired.users == 0:
                del self._retired[slot]
                self._clear(slot)
            return
        name = self._resident.get(slot)
        if name is not None and self._entries[name].users > 0:
            self._entries[name].users -= 1

    def _free_slot(self) -> int | None:
        used = set(self._resident) | set(self._retired)
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        for slot, name in self._resident.items():  # least recently used first
            if self._entries[name].users == 0:
                return slot
        return None

    def _place(self, name: str, entry: _Entry, slot: int) -> None:
        adapter = self._cpu.get(name)
        if adapter is None:
            adapter = self.read(entry.path)  # raises LoraError when it is gone or changed into something unfit
            self.disk_reads += 1
        old = self._resident.pop(slot, None)
        if old is not None:
            self._entries[old].slot = -1
        if self.tables is not None:
            self.tables.set_slot(slot, adapter.weights, 1.0)  # scaling is in B already (peft_format)
        entry.slot = slot
        self._resident[slot] = name
        self._remember(name, adapter)

    def _remember(self, name: str, adapter: Adapter) -> None:
        if self.max_cpu_loras <= 0:
            return
        self._cpu[name] = adapter
        self._cpu.move_to_end(name)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def _clear(self, slot: int) -> None:
        if self.tables is not None:
            self.tables.clear_slot(slot)

    def _known(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise unknown_adapter(name)
        return entry
