"""An incremental suffix index over a token stream: where the stream's current suffix occurred before.

Every bigram maps to the positions where it ended (updated as tokens are appended). A lookup extends each
recent candidate backwards to measure how long the match really is and takes the longest (the most recent on
ties); what followed it is the draft, ``min(k, match - 1)`` tokens long: a two-token coincidence earns one draft
token, a copied paragraph earns the full ``k``.
"""

from __future__ import annotations

from collections import defaultdict

ANCHOR = 2  # tokens a match must share before it is a candidate
MAX_CANDIDATES = 8  # most recent anchor hits examined per draft
MAX_MATCH = 64


class SuffixIndex:
    """``tokens`` and, for every bigram of them, the positions where it ended."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self.ends: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)
        if tokens:
            self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        """Append ``new`` and index the bigrams it completes."""
        start = len(self.tokens)
        self.tokens.extend(new)
        toks = self.tokens
        for j in range(max(start, ANCHOR - 1), len(toks)):
            self.ends[tuple(toks[j - ANCHOR + 1 : j + 1])].append(j)

    def best_match(self) -> tuple[int, int]:
        """(end position of the best earlier match of the current suffix, its length); (-1, 0) if none."""
        tokens = self.tokens
        last = len(tokens) - 1
        best, best_len = -1, 0
        if last < ANCHOR:
            return best, best_len
        for j in reversed(self.ends.get(tuple(tokens[-ANCHOR:]), [])[-MAX_CANDIDATES - 1 :]):
            if j >= last:
                continue
            m = ANCHOR
            while m < MAX_MATCH and j - m >= 0 and tokens[j - m] == tokens[last - m]:
                m += 1
            if m > best_len:
                best, best_len = j, m
        return best, best_len

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the best earlier match (fewer after a short match)."""
        j, m = self.best_match() if k > 0 else (-1, 0)
        n = min(k, m - 1)
        return self.tokens[j + 1 : j + 1 + n] if j >= 0 and n > 0 else []
