"""Incremental detokenization and stop-string matching for one sequence.

Text is released as soon as it is safe: never half a UTF-8 character, and never characters that could
still turn out to be the start of a stop string (those are held back until disproved or the end).
"""

from __future__ import annotations

from fleetllm.models.tokenizer import TokenizerWrapper


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenizerWrapper, stop: list[str], include_stop: bool, skip_special_tokens: bool) -> None:
        self.tok = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all decoded text so far (after stop truncation, if any)
        self.emitted = 0  # characters of ``text`` already released
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token_id: int) -> str | None:
        """Add a token; return the matched stop string if the sequence must stop, else None."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
        if full.endswith("\ufffd"):
            return None  # an incomplete UTF-8 character: wait for the next token
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                return s
        return None

    def release(self, finished: bool) -> str:
        """Text that is safe to send now (everything, once finished)."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
