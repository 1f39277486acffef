"""A request's sequence and its checked state machine.

WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_{STOPPED,LENGTH,ABORTED,ERROR}.
Every transition is looked up in ``TRANSITIONS``; leaving RUNNING requires the sequence to hold no
KV blocks, so a path that forgets to free them fails loudly instead of leaking.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetllm.engine.params import SamplingParams

if TYPE_CHECKING:
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, Status.FINISHED_ABORTED, Status.FINISHED_ERROR}

TRANSITIONS: dict[Status, set[Status]] = {
    Status.WAITING: {Status.RUNNING, Status.FINISHED_ABORTED, Status.FINISHED_ERROR},
    Status.RUNNING: {Status.PREEMPTED} | _FINISHED,
    Status.PREEMPTED: {Status.RUNNING, Status.FINISHED_ABORTED, Status.FINISHED_ERROR},
}


class InvalidTransition(RuntimeError):
    pass


@dataclass
class Sequence:
    """One generation stream: prompt + outputs, its block table and how much of it has KV computed."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full, computed blocks so far
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens it got without computing them (-1: not yet scheduled)
    num_computed_before_preemption: int = 0  # the most tokens it held before a preemption (its own work)
    num_held_tokens: int = 0  # prompt tokens its worker held (pool or a KV tier) when it arrived: no queued work
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # a seeded request's sampling RNG (made by the executor)
    sampler_state: bytes | None = None  # the RNG state to start from instead of the seed (a handed-over prefill)
    spec_state: Any = None  # the speculative decoder's per-request state (acceptance, drafter index)
    grammar: Any = None  # a structured request's GrammarState, advanced by every appended token
    lora_name: str | None = None  # the adapter it runs with (None: the base model)
    lora_slot: int = -1  # its adapter's slot in the step's tables while it runs (-1: none held)
    stop_reason: str | int | None = None
    # timing (monotonic seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, copying only those (a decode step asks for its last one:
        joining a long context's lists first would cost the whole context every step)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_output(self, tok: int, now: float) -> None:
        """Record a new output token and its time."""
        self.output_token_ids.append(tok)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def stop_status(self, tok: int, stop_str: str | None, eos: set[int] | frozenset[int], max_model_len: int) -> Status | None:
        """The finished status the just-appended ``tok`` brings (stop string, EOS, stop token, length), or None."""
        p = self.params
        if stop_str is not None:
            self.stop_reason = stop_str
            return Status.FINISHED_STOPPED
        if not p.ignore_eos and tok in eos:
            return Status.FINISHED_STOPPED
        if tok in p.stop_token_ids:
            self.stop_reason = tok
            return Status.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            return Status.FINISHED_LENGTH
        return None

    def transition(self, new: Status) -> None:
        """Move to ``new``; raise :class:`InvalidTransition` if the table forbids it or blocks would leak."""
        if new not in TRANSITIONS.get(self.status, set()):
            raise InvalidTransition(f"{self.request_id}: {self.status.name} -> {new.name} is not allowed")
        if new is not Status.RUNNING and self.block_table:
            raise InvalidTransition(f"{self.request_id}: {self.status.name} -> {new.name} with {len(self.block_table)} blocks held")
        self.status = new
