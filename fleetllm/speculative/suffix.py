"""Suffix drafting over the session: what followed the longest earlier occurrence of the current suffix.

The text searched is the request's session stream (:mod:`fleetllm.speculative.sessions`): this request's prompt
and output, and the earlier turns of the same agent session (their prompts and replies, kept across turns), so
a tool output echoed back, a JSON key seen three turns ago or a file being edited are drafted from wherever they
appeared. The index itself is :mod:`fleetllm.speculative.suffix_index`.
"""

from __future__ import annotations

from fleetllm.engine.sequence import Sequence
from fleetllm.speculative.drafter import TokenOnlyDrafter, register
from fleetllm.speculative.sessions import DEFAULT_TOKENS, SessionStreams


@register("suffix")
class SuffixDrafter(TokenOnlyDrafter):
    def __init__(self, session_tokens: int = DEFAULT_TOKENS, **_: object) -> None:
        """``session_tokens``: tokens of session history kept across turns (0: each request on its own)."""
        self.sessions = SessionStreams(session_tokens)
        self.shares_history = session_tokens > 0  # drafts from earlier requests' tokens (decoder.varying_drafts)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            stream = self.sessions.stream_for(seq.request_id, seq.prompt_token_ids)
            stream.sync(seq.all_token_ids)
            out.append(stream.index.draft(k))
        return out

    def forget(self, seq: Sequence) -> None:
        if seq.status.finished:
            self.sessions.release(seq.request_id, seq.all_token_ids, len(seq.prompt_token_ids))
