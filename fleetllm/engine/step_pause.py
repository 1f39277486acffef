"""A running step paused between two layers, so that a more urgent request's first token need not wait for it.

Under ``--scheduling-policy priority`` an urgent request that arrives while a step of less urgent rows runs would
wait for that step to end (up to a whole step: ~20 ms for eight bulk rows of the embedded model on one thread),
then for its own. The C decode stack (:mod:`fleetllm.kernels.decode_stack`) looks at a flag after every layer: the
server's thread sets it when such a request arrives (:meth:`StepPause.ask`), the stack returns after the layer it was
running, and the engine thread computes the newcomer's prompt in a step of its own (``LLMEngine.urgent_step``) and
resumes the paused step at the layer where it stopped. Between two layers a step's whole state is its residual
stream (the KV of the layers run is in the pool already), so the resumed step computes exactly what it would have;
its rows' next tokens come later by the urgent prompt's time, as they would have had that prompt gone first.

Who may pause a step (its *guard*, set per step by the engine): a request of priority <= 0 (someone waits on it;
the low band is batch work) that is more urgent than every row of the step, counting a row still computing its
first token as a half level more urgent than its priority. So an arrival never overtakes a first token of its own
priority or better (first come, first served among equals), but does overtake equally urgent rows that are only
decoding: their next token waits for the newcomer's prompt either way, as it would in a step computing both.

Torch-free: the flag is a ``ctypes`` int the C call reads in place; the engine thread alone runs steps.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


class StepPause:
    """The flag a running step looks at between layers, who may set it, and what runs while it is paused."""

    def __init__(self) -> None:
        self.flag = ctypes.c_int(0)  # read by the C stack after each layer (volatile there)
        self.guard: float | None = None  # the step in flight's most urgent row (see the module doc); None: not pausable
        self.on_pause: Callable[[], None] | None = None  # the engine thread's work while a step is paused
        self.pauses = 0  # steps paused so far
        self._paused = False

    def arm(self, guard: float | None) -> None:
        """The step about to run may be paused by an arrival more urgent than ``guard`` (None: by none). Called by
        the engine thread before each step; the guard stays until the next step's, so an arrival between two steps
        pauses the next one after its first layer: admitted there (it came too late for that step's schedule), or
        already admitted by it, the pause then finding nothing to do."""
        self.guard = guard if self.on_pause is not None else None

    def ask(self, priority: int) -> bool:
        """A request of ``priority`` arrived (the server's thread): set the flag when it may pause the step in
        flight. A stale guard (the step ended meanwhile) costs at most one pause that finds nothing to do."""
        guard = self.guard
        if guard is None or priority > 0 or priority >= guard:
            return False
        self.flag.value = 1
        return True

    def address(self) -> int | None:
        """The flag's address for a step's C call; None while a step is paused (the urgent step runs through)."""
        return None if self._paused or self.guard is None else ctypes.addressof(self.flag)

    def pause(self) -> None:
        """The running step stopped between two layers (the engine thread): run :attr:`on_pause`, then return to
        resume it."""
        self.flag.value = 0
        if self.on_pause is None:
            return
        self._paused = True
        self.pauses += 1
        try:
            self.on_pause()
        finally:
            self._paused = False


def step_guard(rows: list[tuple[int, bool]]) -> float | None:
    """The guard of a step whose rows are ``(priority, computing_its_first_token)`` (None: an empty step)."""
    return min((p if first else p + 0.5 for p, first in rows), default=None)
