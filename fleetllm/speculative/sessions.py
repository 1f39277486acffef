"""The suffix drafter's memory of agent sessions: one token stream per session, kept across its turns.

A session is recognised by what every agent loop sends: each turn's prompt extends the one before it (a chat
client resends the whole history with the replies it received; the Responses API's ``previous_response_id``
makes the worker rebuild that prompt; a router's session key only picks the worker). So the engine needs no key
from the client: when a request finishes, its stream is filed under the chained hash of its tokens up to the last
full ``SPAN`` (prompt and output, and the prompt alone in case the client re-tokenises the reply differently),
and a new request whose prompt starts with those tokens takes the stream over. That also keeps one session's
text from drafting for another: a stream is found only by a prompt that already holds it.

A stream is append-only: the new request's tokens past the shared prefix are appended, so what an earlier turn
had and the new prompt dropped (a reply re-rendered by the chat template, a tool output the agent trimmed from its
history) stays searchable. Memory is bounded three ways: ``max_tokens`` in all kept streams (the least recently
used idle ones go first), ``MAX_STREAM`` per stream (its oldest half dropped), and ``IDLE_SECONDS`` since a
session's last turn.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from fleetllm.speculative.suffix_index import SuffixIndex

SPAN = 64  # tokens per prefix key: a new prompt must share a whole span boundary with the earlier turn
MAX_STREAM = 32768  # tokens of one session's stream (beyond: its older half is dropped)
IDLE_SECONDS = 900.0  # a session not continued for this long is dropped
DEFAULT_TOKENS = 131072  # tokens of all kept streams (about 150 bytes each with their index)


def prefix_keys(tokens: list[int], span: int = SPAN) -> list[int]:
    """``keys[i]``: a chained hash of ``tokens[: span * (i + 1)]`` (full spans only)."""
    keys, h = [], 0
    for end in range(span, len(tokens) + 1, span):
        h = hash((h, tuple(tokens[end - span : end])))
        keys.append(h)
    return keys


@dataclass
class Stream:
    """One session's tokens and their suffix index; ``owner`` the request appending to it (None: idle)."""

    index: SuffixIndex = field(default_factory=SuffixIndex)
    owner: str | None = None
    mirrored: int = 0  # tokens of the owner's sequence already in the stream
    keys: list[int] = field(default_factory=list)  # where the store files it while idle
    last_used: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens

    def sync(self, seq_tokens: list[int]) -> None:
        """Append the owner's tokens not yet in the stream (its sequence only ever grows)."""
        self.index.extend(seq_tokens[self.mirrored :])
        self.mirrored = len(seq_tokens)
        if len(self.tokens) > MAX_STREAM:
            self.index = SuffixIndex(self.tokens[-MAX_STREAM // 2 :])


class SessionStreams:
    """Streams by owner (live requests) and by prefix key (idle sessions), within a token budget."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS) -> None:
        self.max_tokens = max_tokens  # 0: no memory across turns (a stream per request, dropped when it ends)
        self.live: dict[str, Stream] = {}
        self.idle: OrderedDict[int, Stream] = OrderedDict()  # prefix key -> stream, least recently used first

    @property
    def tokens(self) -> int:
        """Tokens held in all streams, live and idle."""
        idle = {id(s): s for s in self.idle.values()}
        return sum(len(s.tokens) for s in [*self.live.values(), *idle.values()])

    def stream_for(self, request_id: str, prompt: list[int]) -> Stream:
        """The stream ``request_id`` appends to: the idle session its prompt extends, else a new one."""
        stream = self.live.get(request_id)
        if stream is not None:
            return stream
        self._expire(time.monotonic())
        stream, common = self._continued(prompt) if self.max_tokens else (None, 0)
        if stream is None:
            stream, common = Stream(), 0
        stream.owner, stream.mirrored = request_id, common
        self.live[request_id] = stream
        return stream

    def release(self, request_id: str, tokens: list[int], prompt_len: int) -> None:
        """The request ended: file its stream under its tokens' prefix keys, for the session's next turn."""
        stream = self.live.pop(request_id, None)
        if stream is None or not self.max_tokens:
            return
        stream.owner, stream.last_used = None, time.monotonic()
        whole, prompt = prefix_keys(tokens), prefix_keys(tokens[:prompt_len])
        stream.keys = list(dict.fromkeys(keys[-1] for keys in (whole, prompt) if keys))
        for key in stream.keys:
            old = self.idle.pop(key, None)
            if old is not None and old is not stream:
                self._drop(old)
            self.idle[key] = stream
        self._fit()

    def _continued(self, prompt: list[int]) -> tuple[Stream | None, int]:
        """The idle stream filed under the longest prefix of ``prompt`` and that prefix's length."""
        keys = prefix_keys(prompt)
        for i in range(len(keys) - 1, -1, -1):
            stream = self.idle.get(keys[i])
            if stream is not None:
                self._unfile(stream)
                return stream, SPAN * (i + 1)
        return None, 0

    def _unfile(self, stream: Stream) -> None:
        for key in stream.keys:
            if self.idle.get(key) is stream:
                del self.idle[key]
        stream.keys = []

    def _drop(self, stream: Stream) -> None:
        self._unfile(stream)
        stream.index = SuffixIndex()  # what a live reference still holds is emptied with it

    def _expire(self, now: float) -> None:
        while self.idle:
            stream = next(iter(self.idle.values()))
            if now - stream.last_used < IDLE_SECONDS:
                return
            self._drop(stream)

    def _fit(self) -> None:
        """Drop the least recently used idle streams until all streams fit ``max_tokens``."""
        total = self.tokens
        while self.idle and total > self.max_tokens:
            stream = next(iter(self.idle.values()))
            total -= len(stream.tokens)
            self._drop(stream)
