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

# Candidates top_p-only rows take from a partial sort, widest last (topk's cost grows with k); a nucleus
# wider than them all falls back to a full sort.
TOP_P_CANDIDATES = (64, 1024)


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
        if all(greedy):
            chosen = logits.argmax(dim=-1)  # no softmax, no sort: one pass over the vocabulary
        else:
            chosen = torch.empty(len(params), dtype=torch.long)
            if any(greedy):
                idx = torch.tensor([i for i, g in enumerate(greedy) if g])
                chosen[idx] = logits[idx].argmax(dim=-1)
            rand_rows = [i for i, g in enumerate(greedy) if not g]
            chosen[torch.tensor(rand_rows)] = self._sample(
                logits[rand_rows], [params[i] for i in rand_rows], [generators[i] for i in rand_rows])

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
    def _sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                ) -> torch.Tensor:
        """One token per row, drawn from its temperature / min_p / top_k / top_p distribution.

        Rows with top_k never see a softmax over the vocabulary: the k largest logits are taken (a partial
        sort) and normalized among themselves. Rows with top_p alone take :data:`TOP_P_CANDIDATES` from a
        partial sort, and the whole vocabulary only when the nucleus is wider. The tokens kept are the
        ones a full sort keeps."""
        temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        x = logits / temps
        groups = ([i for i, p in enumerate(params) if p.top_k > 0],
                  [i for i, p in enumerate(params) if p.top_k <= 0 and p.top_p < 1.0],
                  [i for i, p in enumerate(params) if p.top_k <= 0 and p.top_p >= 1.0])
        chosen = torch.empty(len(params), dtype=torch.long)
        for rows, pick in zip(groups, (_top_k_candidates, _top_p_candidates, _all_candidates), strict=True):
            if rows:
                kept, order = pick(x[rows], [params[i] for i in rows])
                picks = _race(kept, [generators[i] for i in rows])
                chosen[rows] = picks if order is None else order.gather(1, picks.unsqueeze(1)).squeeze(1)
        return chosen

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


def _min_p(probs: torch.Tensor, params: list[SamplingParams], top: torch.Tensor) -> torch.Tensor:
    """``probs`` with tokens below min_p times the row's top probability (``top``) zeroed."""
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
    return probs.masked_fill(probs < min_p * top, 0.0) if bool((min_p > 0).any()) else probs


def _all_candidates(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, None]:
    """No top_k / top_p: every token, by its probability (min_p applied); ids are column indices."""
    probs = torch.softmax(x, dim=-1)
    return _min_p(probs, params, probs.max(dim=-1, keepdim=True).values), None


def _top_k_candidates(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top_k: the k largest logits, weighted ``exp(x - max)`` (no normalizer over the vocabulary is
    needed: top_p's mass is over the k kept), min_p and top_p applied; ``(kept, token ids)``."""
    k = max(p.top_k for p in params)
    vals, order = x.topk(min(k, x.shape[-1]), dim=-1)
    probs = _min_p((vals - vals[:, :1]).exp(), params, torch.ones(1))
    probs = probs.masked_fill(torch.arange(probs.shape[-1]) >= torch.tensor([p.top_k for p in params]).unsqueeze(1),
                              0.0)
    return _top_p(probs, params, probs.sum(dim=-1, keepdim=True)), order


def _top_p_candidates(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top_p alone: candidates from a partial sort wide enough to hold each row's nucleus."""
    probs = torch.softmax(x, dim=-1)
    probs = _min_p(probs, params, probs.max(dim=-1, keepdim=True).values)
    total = probs.sum(dim=-1, keepdim=True)
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    for k in (*(c for c in TOP_P_CANDIDATES if c < probs.shape[-1]), probs.shape[-1]):
        sorted_p, order = probs.topk(k, dim=-1)  # k = the vocabulary: a full sort (a nucleus wider than all tries)
        if not bool((sorted_p.sum(dim=-1, keepdim=True) < top_p * total).any()):
            break
    return _top_p(sorted_p, params, total), order


def _top_p(sorted_p: torch.Tensor, params: list[SamplingParams], total: torch.Tensor) -> torch.Tensor:
    """Keep a token while the mass before it is below top_p of ``total`` (the first token always stays)."""
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    if not bool((top_p < 1.0).any()):
        return sorted_p
    cum = sorted_p.cumsum(dim=-1)
    return sorted_p.masked_fill((cum - sorted_p) / total.clamp_min(1e-30) >= top_p, 0.0)


def _race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One index per row drawn in proportion to ``probs`` (unnormalized). Unseeded rows share one
    inverse-CDF draw; a seeded row runs the exponential race ``argmax(p / E)``, E ~ Exp(1), from its own
    generator over its entries up to the last nonzero one, so its token never depends on its neighbours."""
    out = torch.empty(probs.shape[0], dtype=torch.long)
    free = [j for j, g in enumerate(generators) if g is None]
    if free:  # inverse CDF: one uniform per row (torch.multinomial and the race cost ~100x more on 49k tokens)
        cdf = probs[free].cumsum(dim=-1)
        u = (1.0 - torch.rand(len(free), 1)) * cdf[:, -1:]  # in (0, total]: never a zero-probability token
        out[free] = torch.searchsorted(cdf, u).squeeze(1).clamp_max(probs.shape[-1] - 1)
    for j, g in enumerate(generators):
        if g is not None:
            n = int(probs[j].nonzero().max()) + 1
            e = torch.empty(n).exponential_(generator=g)
            out[j] = (probs[j, :n] / e).argmax()
    return out
