"""Encode prompts a segment at a time, remembering segments seen before: a returning conversation
tokenizes only its new turn.

A HF tokenizer cuts the text at its added tokens (``<|im_start|>``, ``<|im_end|>``, ...) before the
pre-tokenizer and BPE run, and encodes each piece between them on its own: no merge crosses an added
token. So the ids of a text are the ids of its pieces, each looked up or encoded once, with the added
tokens' ids between them. A chat rendered by its template is mostly pieces seen before: the shared
system prompt, and every earlier message of the conversation. The router and the worker both encode
every chat this way: profiled under the saturated routing benchmark, encoding the whole history was most
of the router's time per request (a ~2.6k-token history: 77 ms of 100 on a busy core; docs/reliability.md).

This holds only when an added token matches the same way wherever it occurs: one that strips whitespace
around it (``lstrip``/``rstrip``), matches only as a single word, or matches the normalized text would
make a piece's ids depend on its neighbours, so such a tokenizer is encoded whole, as before.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer


class SegmentEncoder:
    """``encode(text)`` equal to ``tok.encode(text, add_special_tokens=False).ids``, pieces cached (LRU)."""

    def __init__(self, tok: Tokenizer, max_ids: int = 1 << 19) -> None:
        self.tok = tok
        self.max_ids = max_ids  # the cache's bound in token ids held: ~2 MB of ids + ~2 MB of text at the default
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()  # the router tokenizes on worker threads
        added = list(tok.get_added_tokens_decoder().items())
        exact = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for _, t in added)
        self.ids = {t.content: i for i, t in added}
        # longest first: at one position the regex takes the longest added token, as the tokenizer does
        names = sorted(self.ids, key=len, reverse=True)
        self.splitter = re.compile("(" + "|".join(map(re.escape, names)) + ")") if exact and names else None

    def encode(self, text: str) -> list[int]:
        if self.splitter is None:
            return self.tok.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for k, piece in enumerate(self.splitter.split(text)):
            if k % 2:  # the splitter's capture: an added token
                ids.append(self.ids[piece])
            elif piece:
                ids += self._piece(piece)
        return ids

    def _piece(self, piece: str) -> array[int] | list[int]:
        with self._lock:
            hit = self._cache.get(piece)
            if hit is not None:
                self._cache.move_to_end(piece)
                return hit
        ids = self.tok.encode(piece, add_special_tokens=False).ids
        with self._lock:
            if piece not in self._cache:
                self._cache[piece] = array("i", ids)  # 4 bytes an id, not a list's 8 + an int object's 28
                self._held += len(ids)
            while self._held > self.max_ids:
                self._held -= len(self._cache.popitem(last=False)[1])
        return ids
