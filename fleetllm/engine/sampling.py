"""Per-request sampling parameters and the batched sampler.

Order of logit processing (as in vLLM): repetition / presence / frequency penalties, temperature,
min_p, top_k, top_p, then sampling. Log-probabilities are reported from the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class InvalidParameter(ValueError):
    """A request parameter is out of range; ``param`` names it for the API error."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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
        ]
        for name, ok, msg in checks:
            if not ok:
                raise InvalidParameter(name, f"{name} {msg}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # chosen token's log-probability per row (None: none asked for)
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Samples one token per row of a ``[N, V]`` logits batch, each row with its own parameters."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> SampleResult:
        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(want_lp) else None
        logits = logits.float()
        if any(p.needs_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), params, prompt_ids, output_ids)

        greedy = [p.greedy for p in params]
        chosen = torch.empty(len(params), dtype=torch.long)
        if any(greedy):
            idx = torch.tensor([i for i, g in enumerate(greedy) if g])
            chosen[idx] = logits[idx].argmax(dim=-1)
        rand_rows = [i for i, g in enumerate(greedy) if not g]
        if rand_rows:
            idx = torch.tensor(rand_rows)
            probs = self._probs(logits[idx], [params[i] for i in rand_rows])
            # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, per-row generator for seeds.
            for j, i in enumerate(rand_rows):
                e = torch.empty_like(probs[j]).exponential_(generator=generators[i])
                chosen[i] = (probs[j] / e).argmax()

        ids = chosen.tolist()
        lps = tops = None
        if raw_logprobs is not None:
            lps = [float(raw_logprobs[i, t]) if want_lp[i] else 0.0 for i, t in enumerate(ids)]
            k = max(p.logprobs or 0 for p in params)
            tops = [[] for _ in params]
            if k > 0:
                vals, top_idx = raw_logprobs.topk(k, dim=-1)
                for i, p in enumerate(params):
                    n = p.logprobs or 0
                    tops[i] = list(zip(top_idx[i, :n].tolist(), vals[i, :n].tolist(), strict=True))
        return SampleResult(ids, lps, tops)

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temps
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        top_k = [p.top_k if p.top_k > 0 else probs.shape[-1] for p in params]
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        if min(top_k) < probs.shape[-1] or (top_p < 1.0).any():
            sorted_p, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1]).unsqueeze(0)
            drop = ranks >= torch.tensor(top_k).unsqueeze(1)
            cum = sorted_p.masked_fill(drop, 0.0).cumsum(dim=-1)
            total = cum[:, -1:].clamp_min(1e-30)
            # keep a token while the mass before it is below top_p (the first token always stays)
            drop |= (cum - sorted_p) / total >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        return probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        for i, p in enumerate(params):
            if not p.needs_penalties:
                continue
            out = torch.tensor(output_ids[i], dtype=torch.long)
            counts = torch.bincount(out, minlength=vocab)[:vocab].float() if len(out) else torch.zeros(vocab)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                if prompt_ids[i]:
                    seen[torch.tensor(prompt_ids[i], dtype=torch.long).clamp_max(vocab - 1)] = True
                row = logits[i]
                pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                logits[i] = torch.where(seen, pen, row)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits
