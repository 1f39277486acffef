"""What the engine hands back per step and request (torch-free, shared with the simulated worker)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestTiming:
    """A finished request's phase boundaries (monotonic seconds): queue = arrival..scheduled,
    prefill = scheduled..first token, decode = first token..finished."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta; ``finished`` marks the last one)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    timing: RequestTiming | None = None  # on the final output only
    sampler_state: bytes | None = None  # final output of a seeded request: its RNG state (a prefill hands it over)
