"""Speculative decoding as the recommender sees it: tokens per verify step (AL) and what drafting costs.

AL = 1 + accepted / verify steps, measured per drafter and workload category by
``benchmarks/speculative.py`` (BENCHMARKS.md, "Speculative decoding", 2026-12-03, SmolLM2-135M on this
machine). Acceptance depends on the drafter and the text far more than on the hardware, so the same
figures stand for a GPU deployment; for a target other than SmolLM2 they are an assumption (an EAGLE
head trained for a larger target accepts more), which the report says.
"""

from __future__ import annotations

from dataclasses import dataclass

# (method, K) -> category -> AL
MEASURED_AL: dict[tuple[str, int], dict[str, float]] = {
    ("ngram", 4): {"chat": 1.67, "code": 2.5, "agentic": 3.6, "random": 1.0},
    ("suffix", 4): {"chat": 1.43, "code": 2.3, "agentic": 2.8, "random": 1.0},
    ("eagle", 2): {"chat": 1.24, "code": 1.58, "agentic": 1.39},
    ("eagle", 4): {"chat": 1.28, "code": 1.7, "agentic": 1.45},
}
DRAFT_COST = {"ngram": 0.0, "suffix": 0.0, "eagle": 0.08}  # per drafted token, as a fraction of a decode step
# (method, K) -> category -> share of decode steps that verify a draft (1.0 where not listed). A copy-based drafter
# (n-gram, suffix) proposes only where the text repeats: on random words ("random", `fleetllm bench`'s synthetic
# prompts) it found nothing to copy (2026-12-03 first pass: ITL 140 ms with ngram k=4, 138 without; the worker's
# counters on 2026-12-04: drafts on 2-4% of decode steps), so its decodes stay one token wide.
DRAFT_SHARE: dict[tuple[str, int], dict[str, float]] = {("ngram", 4): {"random": 0.0}, ("suffix", 4): {"random": 0.0}}


@dataclass(frozen=True)
class Speculation:
    method: str = "none"
    k: int = 0

    @property
    def on(self) -> bool:
        return self.method != "none"

    def acceptance_length(self, category: str) -> float:
        if not self.on:
            return 1.0
        table = MEASURED_AL[(self.method, self.k)]
        return table.get(category, table["chat"])

    def verify_width(self, category: str) -> float:
        """Positions a decode verifies per step on average: 1 + K on the steps that verify a draft."""
        if not self.on:
            return 1.0
        return 1.0 + self.k * DRAFT_SHARE.get((self.method, self.k), {}).get(category, 1.0)

    def draft_cost(self) -> float:
        """Drafting time per verify step as a fraction of one decode step."""
        return DRAFT_COST.get(self.method, 0.0) * self.k if self.on else 0.0

    @property
    def engine_flag(self) -> str | None:
        """The ``--speculative`` value for ``fleetllm worker``."""
        return f"method={self.method},k={self.k},adaptive=0" if self.on else None

    def __str__(self) -> str:
        return f"{self.method} k={self.k}" if self.on else "none"


CHOICES = [Speculation()] + [Speculation(m, k) for m, k in MEASURED_AL]
