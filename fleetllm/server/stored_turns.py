"""What the Responses API keeps between turns: items in one checked form, bounded stores, one owner per turn.

A client's ``input`` items are checked and normalised (:func:`normalize_items`) before anything is kept: each
is a ``message`` (a role and its text), a ``function_call`` or a ``function_call_output``, with string fields
only; a key the API does not define, a part that is not text, or more characters than one request may carry
(:data:`fleetllm.server.limits.MAX_PROMPT_CHARS`) is a 400 naming ``input``. So a stored turn holds nothing a
client added beside the conversation, and never more than a request could.

The worker keeps conversations (:mod:`fleetllm.server.responses`), the router turns
(:mod:`fleetllm.router.sessions`), both in a :class:`BoundedStore`: least recently used first out past a count
or a total of characters. A turn belongs to the API key that stored it: the router passes the key's id to its
workers in :data:`OWNER_HEADER` (a client's own such header never passes the router), and a turn named by
another key is not found (404), as if it did not exist.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, TypeVar

from fleetllm.server.errors import APIError
from fleetllm.server.limits import check_chars

OWNER_HEADER = "x-fleetllm-key-id"  # the id of the API key a request came with (set by the router only)
MAX_STORED_CHARS = 256 * 2**20  # characters one store keeps in all (conversations share their history: counted again)
ROLES = ("user", "assistant", "system", "developer")
_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
           "function_call_output": ("call_id", "output")}
_OPTIONAL = ("type", "id", "status")  # what output items carry beside their fields (checked, not kept)
MAX_ID_CHARS = 256
_TEXT_PARTS = ("input_text", "output_text", "text")
V = TypeVar("V")


def normalize_items(raw: Any) -> list[dict[str, str]]:
    """A Responses ``input`` (a string, or a list of items) as items of the forms above; APIError 400 (``input``)."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "input must be a string or a non-empty list of items", "input")
    items = [_item(it, i) for i, it in enumerate(raw)]
    check_chars(items_chars(items), "input")
    return items


def _item(it: Any, i: int) -> dict[str, str]:
    kind = it.get("type", "message") if isinstance(it, dict) else None
    if kind not in _FIELDS:
        raise APIError(400, f"input[{i}]: unsupported item type {str(kind)[:40]!r}", "input")
    fields = _FIELDS[kind]
    extra = [k for k in it if k not in fields and k not in _OPTIONAL]
    if extra:
        raise APIError(400, f"input[{i}]: unknown field {str(extra[0])[:40]!r} in a {kind} item", "input")
    if any(not isinstance(it.get(k, ""), str) or len(it.get(k, "")) > MAX_ID_CHARS for k in _OPTIONAL):
        raise APIError(400, f"input[{i}]: type, id and status must be strings of at most {MAX_ID_CHARS}", "input")
    out = {"type": kind}
    for f in fields:
        v = _content(it.get(f), i) if f == "content" else it.get(f, "" if f == "output" else None)
        if not isinstance(v, str):
            raise APIError(400, f"input[{i}].{f} must be a string", "input")
        out[f] = v
    if kind == "message" and out["role"] not in ROLES:
        raise APIError(400, f"input[{i}].role must be one of {', '.join(ROLES)}", "input")
    return out


def _content(content: Any, i: int) -> Any:
    """A message's text: a string, or its text parts joined."""
    if not isinstance(content, list):
        return content
    texts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS or not isinstance(p.get("text", ""), str):
            raise APIError(400, f"input[{i}].content: only text parts are supported", "input")
        texts.append(p.get("text", ""))
    return "".join(texts)


def items_chars(items: list[dict[str, Any]]) -> int:
    """The characters of items' (or chat messages') string fields: the measure stores are bounded by."""
    return sum(len(v) for it in items for v in it.values() if isinstance(v, str))


class BoundedStore(Generic[V]):
    """Values by id, each with its owner and size; the least recently used go once there are more than
    ``capacity`` or their sizes pass ``max_chars``."""

    def __init__(self, capacity: int, max_chars: int = MAX_STORED_CHARS) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self._items: OrderedDict[str, tuple[V, str, int]] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Any, owner: str) -> V | None:
        """The value stored under ``key`` by ``owner`` (None: none, or another owner's)."""
        held = self._items.get(key) if isinstance(key, str) else None
        if held is None or held[1] != owner:
            return None
        self._items.move_to_end(key)
        return held[0]

    def put(self, key: str, value: V, owner: str, size: int) -> None:
        if key in self._items:
            self.chars -= self._items.pop(key)[2]
        self._items[key] = (value, owner, size)
        self.chars += size
        while self._items and (len(self._items) > self.capacity or self.chars > self.max_chars):
            self.chars -= self._items.popitem(last=False)[1][2]
