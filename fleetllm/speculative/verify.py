"""The lossless acceptance rule for deterministic drafts (the proposal q is a point mass on each draft).

Row i of ``logits`` is the target's next-token distribution after the last sampled token and drafts
``1..i``. Greedy: accept while the draft equals the argmax; the first mismatch emits the argmax.
Sampling: p is the request's distribution after temperature / min_p / top-k / top-p (exactly what the
plain sampler draws from); accept draft x with probability min(1, p(x)/q(x)) = p(x); on rejection draw
from normalise(max(0, p - q)) = p without x; if all K pass, draw a bonus token from the last row. Each
emitted token is then distributed exactly as the target alone would have produced it.
"""

from __future__ import annotations

import torch

from fleetllm.engine.sampling import Sampler, SamplingParams


def verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """Tokens to emit: the accepted prefix of ``drafts`` plus one target token (correction or bonus)."""
    k = len(drafts)
    if params.greedy:
        target = logits[: k + 1].argmax(dim=-1).tolist()
        for i, d in enumerate(drafts):
            if target[i] != d:
                return drafts[:i] + [target[i]]
        return drafts + [target[k]]
    probs = Sampler._probs(logits[: k + 1], [params] * (k + 1))
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        if u < probs[i, d].item():
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        return drafts[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [int(torch.multinomial(probs[k], 1, generator=generator))]
