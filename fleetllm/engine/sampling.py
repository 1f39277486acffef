"""Per-request sampling parameters and the batched sampler.

Order of logit processing (as in vLLM): the structured-output token masks, repetition / presence /
frequency penalties, temperature, min_p, top_k, top_p, then sampling. Log-probabilities are reported
from the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetllm.engine.params import InvalidParameter, SamplingParams

__all__ = ["InvalidParameter", "SampleResult", "Sampler", "SamplingParams"]


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
        masks: torch.Tensor | None = None,
    ) -> SampleResult:
        """``masks``: a structured-output bitmask per row (:mod:`fleetllm.structured.matcher`), or None."""
        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(want_lp) else None
        logits = logits.float()
        if masks is not None:
            from fleetllm.structured.matcher import apply_masks

            logits = apply_masks(logits, masks)
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
