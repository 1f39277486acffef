"""One request's grammar state: the next-token mask, advancing by accepted tokens, checking drafts.

The bitmask is llguidance's: int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is
allowed. :func:`apply_masks` turns rows of it into ``-inf`` logits without llguidance's torch.compile'd
kernel (a compile on first use would stall the step loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # imported by whoever builds matchers (the grammar compiler), not on every worker's start
    import llguidance


class GrammarState:
    """A request's position in its grammar (an llguidance matcher of its own)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``mask[row]``."""
        self._m.unsafe_compute_mask_ptr(mask[row].data_ptr(), mask.shape[1] * 4)

    def fill_masks_through(self, mask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Masks for ``1 + len(drafts)`` rows from ``row``: now, then after each draft (drafts must be valid)."""
        for i, tok in enumerate(drafts):
            self.fill_mask(mask, row + i)
            self._m.consume_token(tok)
        self.fill_mask(mask, row + len(drafts))
        if drafts:
            self._m.rollback(len(drafts))

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar forbids it (the state is then in error)."""
        return bool(self._m.consume_token(token_id))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows as the only way on from here (e.g. a tool call's fixed keys)."""
        return self._m.compute_ff_tokens()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order from here, the grammar allows."""
        return self._m.validate_tokens(tokens)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (its EOS was consumed)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


def allocate_masks(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for ``rows`` rows."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens a row's mask forbids (and those past its width) at ``-inf``; out of place
    (the runner's logits are inference tensors). On host logits the work is two NumPy passes: a handful of
    small torch ops costs more in thread hand-offs than in arithmetic (tens of ms on a busy 2-core host)."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    allowed = bits[:, :vocab].view(np.bool_)
    if logits.device.type != "cpu":
        return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
    return torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)).astype(np.float32, copy=False))
