"""The router's store of Responses API turns: ``previous_response_id`` → the worker that answered.

A worker keeps a stored response's conversation (and its KV) itself, so a follow-up turn naming
``previous_response_id`` must reach that worker: the router pins it there. The router also keeps each
turn's items (the input it was sent and the output it produced, as Responses items), linked to the turn
before, so when the pinned worker is gone (removed, unhealthy, draining, or it failed before its first
byte) the turn is re-sent to another worker with the whole conversation inline instead of a
``previous_response_id`` that worker would not know.

Bounded by the number of turns it indexes and by their characters (least recently used dropped first; a
turn counts its whole history, :mod:`fleetllm.server.stored_turns`). A turn keeps its parent alive through its
link, so a live session's history survives the eviction of its older ids; memory is one copy of each turn's
items, shared by every later turn of the session. Items are kept only in their checked, normalised form, and a
turn is found only with the API key that stored it (``owner``): another key's follow-up is neither pinned nor
re-sent with that conversation.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetllm.server.errors import APIError
from fleetllm.server.stored_turns import MAX_STORED_CHARS, BoundedStore, items_chars, normalize_items

_DONE = (b'"response.completed"', b'"response.incomplete"')


@dataclass
class Turn:
    """One stored response: where it was produced and what it added to the conversation."""

    worker: str  # the worker's name (host:port), as in WorkerState.name
    items: list[dict[str, Any]]  # this turn's input items, then its output items
    parent: Turn | None = None
    response_id: str = ""  # the response's id (its turn is stored under it)
    owner: str = ""  # the id of the API key that stored it ("": a router without keys)
    chars: int = field(init=False)  # of the whole conversation up to this turn

    def __post_init__(self) -> None:
        self.chars = items_chars(self.items) + (self.parent.chars if self.parent else 0)

    def history(self) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this turn, oldest first."""
        chain, t = [], self
        while t is not None:
            chain.append(t.items)
            t = t.parent
        return [it for items in reversed(chain) for it in items]


class ResponseSessions:
    """The last ``capacity`` response ids this router saw answered (at most ``max_chars`` characters of turns
    in all), each with its :class:`Turn`."""

    def __init__(self, capacity: int = 4096, on_record: Callable[[str, Turn], None] | None = None,
                 max_chars: int = MAX_STORED_CHARS) -> None:
        self.on_record = on_record  # also told of every turn answered here (--state-url: shared with other routers)
        self._turns: BoundedStore[Turn] = BoundedStore(capacity, max_chars)

    def __len__(self) -> int:
        return len(self._turns)

    def get(self, response_id: Any, owner: str = "") -> Turn | None:
        """The turn stored under ``response_id`` by ``owner`` (None: none, or another key's)."""
        return self._turns.get(response_id, owner)

    def put(self, response_id: str, turn: Turn) -> None:
        self._turns.put(response_id, turn, turn.owner, turn.chars)

    def record(self, response_id: str, turn: Turn) -> None:
        """A turn answered through this router."""
        self.put(response_id, turn)
        if self.on_record is not None:
            self.on_record(response_id, turn)

    def watch(self, body: dict[str, Any], owner: str = "") -> ResponseWatch | None:
        """A watch that records the answer to ``body`` (None when the answer will not be stored); APIError 400
        when its input items are malformed."""
        if body.get("store") is False:
            return None
        parent = self.get(body.get("previous_response_id"), owner)
        return ResponseWatch(self, parent, input_items(body, parent is None), owner)


def input_items(body: dict[str, Any], first_turn: bool) -> list[dict[str, Any]]:
    """A request's input as Responses items; a first turn's ``instructions`` become a system item (a
    worker applies ``instructions`` only to a conversation's first turn)."""
    items: list[dict[str, Any]] = normalize_items(body.get("input"))
    if first_turn and body.get("instructions"):
        items.insert(0, {"type": "message", "role": "system", "content": str(body["instructions"])})
    return items


def resend_body(body: dict[str, Any], parent: Turn) -> bytes:
    """``body`` with its conversation inline: what any worker can answer without the previous turn."""
    out = {k: v for k, v in body.items() if k not in ("previous_response_id", "instructions")}
    out["input"] = parent.history() + input_items(body, False)
    return json.dumps(out).encode()


class ResponseWatch:
    """Reads a relayed answer (a Response object, or the stream's ``response.completed`` event) and
    stores its turn under the response's id."""

    def __init__(self, sessions: ResponseSessions, parent: Turn | None, items: list[dict[str, Any]],
                 owner: str = "") -> None:
        self.sessions, self.parent, self.items, self.owner = sessions, parent, items, owner
        self._rest = b""
        self._response: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        """A chunk of an SSE stream; only the final event is parsed."""
        *events, self._rest = (self._rest + chunk).split(b"\n\n")
        for ev in events:
            at = ev.find(b"data: {")
            if at >= 0 and any(k in ev for k in _DONE):
                with contextlib.suppress(ValueError, AttributeError):
                    self._response = json.loads(ev[at + 6 :]).get("response")

    def body(self, raw: bytes) -> None:
        """A whole (non-streamed) answer."""
        with contextlib.suppress(ValueError):
            self._response = json.loads(raw)

    def finish(self, worker: str, status: int) -> None:
        """The answer ended on ``worker``: store its turn if it was a stored response."""
        r = self._response
        if status != 200 or not isinstance(r, dict) or not isinstance(r.get("id"), str) or r.get("store") is False:
            return
        output = [it for it in r.get("output") or [] if isinstance(it, dict) and it.get("type") in ("message", "function_call")]
        try:
            kept = normalize_items(output) if output else []
        except APIError:  # an answer this router cannot read back is not worth keeping
            return
        self.sessions.record(r["id"], Turn(worker, self.items + kept, self.parent, r["id"], self.owner))
