"""What a routing pipeline reads about a request, and what it decides: :class:`RouteRequest` in,
:class:`Decision` out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # httpx, which upstream imports, is no part of a worker's start (the CLI imports this module)
    from collections.abc import Callable

    from fleetllm.router.upstream import WorkerState


@dataclass
class RouteRequest:
    """What a policy may look at: the prompt's tokens and block hashes (when the router could
    tokenize it), its length, and a session key."""

    num_prompt_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    block_size: int = 16
    session_key: str | None = None
    lora_name: str | None = None  # the LoRA adapter the request names (None: the base model)
    scheme_hashes: dict[str, list[int]] = field(default_factory=dict)  # other engines' hashes (vLLM's), by scheme
    expected_output_tokens: float = 1.0  # what it will generate, as the router expects (pipeline/output_length.py)
    # released by flow control as work that is not bulk: a worker under priority scheduling gives it the batch slot
    # of one of this router's bulk requests there, so those are not load it waits behind (pickers.least_loaded)
    urgent: bool = False

    def hashes_for(self, w: WorkerState) -> list[int]:
        """The prompt's block hashes as ``w``'s index entries are keyed."""
        return self.scheme_hashes.get(w.hash_scheme, []) if w.hash_scheme else self.block_hashes

    @property
    def tokenized(self) -> bool:
        """Whether the router could tokenize the prompt (what prefix scoring needs)."""
        return bool(self.block_hashes or self.scheme_hashes or self.num_prompt_tokens)


@dataclass
class Decision:
    worker: WorkerState
    reason: str
    cached_tokens: int = 0  # the router's estimate of this request's prefix hit on ``worker``
    headers: dict[str, str] = field(default_factory=dict)  # sent to ``worker`` only (a P/D handoff's id)
    on_end: Callable[[bool], None] | None = None  # once the attempt on ``worker`` ended: whether it answered

    def uncached_tokens(self, req: RouteRequest) -> int:
        return max(0, req.num_prompt_tokens - self.cached_tokens)
