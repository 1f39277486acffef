"""How many tokens a request will generate, as the routing cost needs it: the decode part of a request's cost is
its expected output tokens times what each of its steps costs on a worker (:meth:`CostModel.decode_s`).

Per served model, the router keeps a moving average of the answers it relayed (their ``usage``, or one token per
streamed content delta); a request's expectation is that average, capped by the most it asked for
(``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``). Before a model's first answer, the cap, or
:data:`FIRST_GUESS` without one."""

from __future__ import annotations

from typing import Any

FIRST_GUESS = 16.0  # tokens expected of a request that names no cap, before its model has answered once
WEIGHT = 0.1  # each answer's weight in its model's average (about the last 20 answers count)
_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class OutputLengths:
    """Per served model, the moving average of output tokens per answer."""

    def __init__(self) -> None:
        self._mean: dict[str, float] = {}

    def observe(self, model: str, tokens: int) -> float:
        """One answer of ``model`` ended normally with ``tokens`` output tokens; return the model's new average."""
        mean = self._mean.get(model)
        self._mean[model] = new = float(tokens) if mean is None else mean + WEIGHT * (tokens - mean)
        return new

    def expected(self, model: str, body: dict[str, Any]) -> float:
        """Output tokens expected of ``body``, a request for ``model`` (at least 1)."""
        caps = [v for k in _CAPS if isinstance(v := body.get(k), int) and not isinstance(v, bool) and v > 0]
        mean = self._mean.get(model)
        if mean is None:
            return float(min(caps)) if caps else FIRST_GUESS
        return max(1.0, min([mean, *caps]))
