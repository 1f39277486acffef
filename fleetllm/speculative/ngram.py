"""Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens, draft what followed.

No state and no training; strong wherever the output copies its input (code edits, tool output, quotes).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fleetllm.engine.sequence import Sequence
from fleetllm.speculative.drafter import TokenOnlyDrafter, register


def lookup(tokens: np.ndarray, k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the longest suffix (``min_n..max_n``)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: size - 1], n)  # every earlier n-gram (the suffix itself excluded)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@register("ngram")
class NgramDrafter(TokenOnlyDrafter):
    def __init__(self, max_n: int = 4, min_n: int = 2, **_: object) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [
            lookup(np.asarray(s.all_token_ids, dtype=np.int64), k, self.max_n, self.min_n) if k > 0 else []
            for s, k in zip(seqs, ks, strict=True)
        ]
