"""Adaptive K: how many drafts each decoding request verifies in the next step, decided for the whole batch.

A step's rows are shared: a row one request adds slows the step for every request in it, and what a row
costs depends on how many there are (a kernel switching at a row count, GEMMs turning compute-bound).
So K is not chosen per request as if the whole batch drafted alike; the batch's drafts are chosen at
once. Request i, whose next draft is accepted with probability ``a_i`` (given the ones before it were),
expects ``a_i ** j`` more tokens from its j-th draft. For D drafts in all, the best split takes the D
largest of those across the batch (each request's shrink with j); the step then emits B + their sum
tokens in ``cost(B + D, v) + drafting`` seconds, v the requests verifying. The D with the most tokens per
second wins, the smallest within ``TIE`` of it (a measured cost is not exact: fewer drafts when it is a
toss-up), if it beats the step without them by ``min_gain``; else nobody drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Drafts must beat plain decoding by this much: what a step costs is measured before serving and misses
# some of speculation's own work per step (bookkeeping, features), which matters when the gain is thin.
MIN_GAIN = 1.10
TIE = 1.02

StepSeconds = Callable[[int, int], float]  # (rows, requests verifying) -> seconds of the target's step
ContextSeconds = Callable[[int, int], float]  # (request, its drafts) -> seconds its context adds to the step


def choose_ks(rates: Sequence[float], caps: Sequence[int], cost: StepSeconds,
              draft_seconds: Callable[[int], float] = lambda longest: 0.0,
              floors: Sequence[int] | None = None, min_gain: float = MIN_GAIN,
              context: ContextSeconds | None = None) -> list[int]:
    """Drafts per request for the next step of ``len(rates)`` decoding requests.

    ``rates``: each request's acceptance probability per draft; ``caps``: the most drafts it may get;
    ``cost``: the step's seconds; ``draft_seconds(longest)``: drafting's seconds when the longest draft is
    ``longest`` (0 for 0); ``floors``: drafts a request gets regardless (a probe of its acceptance), the
    baseline the others must beat; ``context(i, k)``: what request i's context adds to the step when it
    verifies k drafts (its rows' attention over its earlier tokens, which ``cost`` measured short).
    """
    base = [min(f, c) for f, c in zip(floors, caps, strict=True)] if floors else [0] * len(rates)
    marginal = sorted(((a**j, i) for i, a in enumerate(rates) if a > 0 for j in range(base[i] + 1, caps[i] + 1)),
                      key=lambda g: -g[0])
    ks = list(base)
    tokens = len(rates) + sum(a**j for a, k in zip(rates, ks, strict=True) for j in range(1, k + 1))
    rows, verifying, longest = len(rates) + sum(ks), sum(k > 0 for k in ks), max(ks, default=0)
    ctx = context or (lambda i, k: 0.0)
    extra = sum(ctx(i, k) for i, k in enumerate(ks))
    speeds = [tokens / (cost(rows, verifying) + extra + draft_seconds(longest))]
    for gain, i in marginal:
        verifying += ks[i] == 0
        extra += ctx(i, ks[i] + 1) - ctx(i, ks[i])
        ks[i] += 1
        longest = max(longest, ks[i])
        tokens, rows = tokens + gain, rows + 1
        speeds.append(tokens / (cost(rows, verifying) + extra + draft_seconds(longest)))
    best, floor = max(speeds), speeds[0] * min_gain
    drafts = 0 if best < floor else next(d for d, s in enumerate(speeds) if s * TIE >= best and s >= floor)
    ks = list(base)
    for _, i in marginal[:drafts]:
        ks[i] += 1
    return ks
