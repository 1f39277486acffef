"""Per-request sampling parameters and their validation (torch-free: the router and the simulated
worker import it without loading PyTorch)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fleetllm.structured.spec import GrammarSpec


class InvalidParameter(ValueError):
    """A request parameter is out of range; ``param`` names it for the API error."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidParameter):
    """The prompt (plus the tokens asked for) does not fit the context."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(param, message)


# A request's scheduling priority (``priority``, as vLLM's): lower is served first; a signed 32-bit integer.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1

MAX_STOP = 64  # stop strings per request: each is checked against every new token's text
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256  # stop token ids per request: each new token is looked up among them


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives per token; 0 = only the chosen token
    skip_special_tokens: bool = True
    n: int = 1
    structured: GrammarSpec | None = None  # constrain the output (JSON schema, regex, choice, grammar)
    priority: int = 0  # lower is served first under --scheduling-policy priority (ignored under fcfs)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidParameter` naming the first parameter out of range."""
        checks = [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (off) or >= 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("n", 1 <= self.n <= 16, "must be in [1, 16]"),
            ("priority", PRIORITY_MIN <= self.priority <= PRIORITY_MAX,
             f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in a signed 64-bit integer"),
            ("stop", len(self.stop) <= MAX_STOP and all(len(x) <= MAX_STOP_CHARS for x in self.stop),
             f"must be at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(0 <= t < 2**31 for t in self.stop_token_ids),
             f"must be at most {MAX_STOP_TOKEN_IDS} token ids"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise InvalidParameter(name, f"{name} {msg}, got {_short(getattr(self, name))}")

    def for_choice(self, k: int) -> SamplingParams:
        """The parameters of the request's ``k``-th choice (of ``n``): one sample, its seed the request's + k
        (folded into the signed 64-bit range)."""
        seed = None if self.seed is None else (self.seed + k + 2**63) % 2**64 - 2**63
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0



def check_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise :class:`InvalidParameter` naming the first parameter out of range for a model of ``vocab_size``
    tokens: the worker's check at its edge, the engine's when a request is added, and the check that blames a
    request for a failed step (its parameters may have changed since)."""
    params.validate()
    if params.top_k > vocab_size:
        raise InvalidParameter("top_k", f"top_k must be -1 (off) or at most the vocabulary's {vocab_size} tokens, "
                               f"got {_short(params.top_k)}")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise InvalidParameter("logprobs", f"logprobs must be at most the vocabulary's {vocab_size} tokens")


def check_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                 default_max_tokens: int | None = None) -> int:
    """Validate a prompt (and the parameters, :func:`check_params`) against the context and vocabulary;
    return the request's resolved max_tokens.

    ``default_max_tokens`` caps an unset ``max_tokens`` (None: all the room left in the context)."""
    check_params(params, vocab_size)
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidParameter("prompt", "the prompt is empty")
    if n >= max_model_len:
        raise PromptTooLong(f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, your prompt has {n} tokens; no room is left for output.")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise InvalidParameter("prompt", f"token ids must be in [0, {vocab_size})")
    room = max_model_len - n
    if params.max_tokens is not None:
        max_tokens = params.max_tokens
    else:
        max_tokens = room if default_max_tokens is None else min(room, default_max_tokens)
    if max_tokens > room:
        raise PromptTooLong(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion).",
                            "max_tokens")
    return max_tokens


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
