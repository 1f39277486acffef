"""Suffix matching: the longest suffix of the sequence seen before, drafting longer for longer matches.

Per request an index maps every bigram to the positions where it ended (updated incrementally as tokens
arrive). A draft extends each recent candidate backwards to measure how long the match really is, takes
the longest (the most recent on ties) and drafts ``min(k, match - 1)`` tokens from what followed it: a
two-token coincidence earns one draft token, a copied paragraph earns the full ``k``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fleetllm.engine.sequence import Sequence
from fleetllm.speculative.drafter import TokenOnlyDrafter, register

ANCHOR = 2  # tokens a match must share before it is a candidate
MAX_CANDIDATES = 8  # most recent anchor hits examined per draft
MAX_MATCH = 64


@dataclass
class SuffixIndex:
    ends: defaultdict[tuple[int, ...], list[int]] = field(default_factory=lambda: defaultdict(list))
    indexed: int = 0  # positions < indexed are in ``ends``

    def update(self, tokens: list[int]) -> None:
        for j in range(max(self.indexed, ANCHOR - 1), len(tokens)):
            self.ends[tuple(tokens[j - ANCHOR + 1 : j + 1])].append(j)
        self.indexed = len(tokens)

    def best_match(self, tokens: list[int]) -> tuple[int, int]:
        """(end position of the best earlier match of the current suffix, its length); (-1, 0) if none."""
        last = len(tokens) - 1
        best, best_len = -1, 0
        for j in reversed(self.ends.get(tuple(tokens[-ANCHOR:]), [])[-MAX_CANDIDATES - 1 :]):
            if j >= last:
                continue
            m = ANCHOR
            while m < MAX_MATCH and j - m >= 0 and tokens[j - m] == tokens[last - m]:
                m += 1
            if m > best_len:
                best, best_len = j, m
        return best, best_len


@register("suffix")
class SuffixDrafter(TokenOnlyDrafter):
    def __init__(self, **_: object) -> None:
        self.index: dict[str, SuffixIndex] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            tokens = seq.all_token_ids
            idx = self.index.setdefault(seq.request_id, SuffixIndex())
            idx.update(tokens)
            j, m = idx.best_match(tokens) if k > 0 and len(tokens) > ANCHOR else (-1, 0)
            n = min(k, m - 1)
            out.append(tokens[j + 1 : j + 1 + n] if j >= 0 and n > 0 else [])
        return out

    def forget(self, seq: Sequence) -> None:
        if seq.status.finished:
            self.index.pop(seq.request_id, None)

