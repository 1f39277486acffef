"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``): what a ``--kv-events-config`` ZMQ publisher sends.

Each message is three frames: the topic, an 8-byte big-endian sequence number, and a msgpack ``EventBatch``
(``ts``, ``events``, ``data_parallel_rank``). Events are ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``, optional ``extra_keys``...),
``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``, tagged by class name. vLLM encodes them
with msgspec, and the shape changed between versions: batches and events as positional arrays
(``array_like=True``, tag first), an array batch with tagged-map events, then both as maps with a ``type`` key.
:func:`decode_batch` reads all three; :func:`encode_batch` writes the maps form.

The replay socket (a ROUTER) takes ``[b"", start_seq]`` from a DEALER and answers ``[b"", seq, payload]`` for
each buffered batch from ``start_seq`` on, then ``[b"", -1 as 8 signed bytes, b""]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from fleetllm.router.backends.vllm_hash import external_hash

END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


@dataclass
class KVEvent:
    """One decoded event; ``hashes`` are index keys (:func:`~fleetllm.router.backends.vllm_hash.external_hash`)."""

    kind: str
    hashes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_size: int | None = None
    lora: Any = None
    medium: str | None = None  # where the worker holds the blocks: "GPU" (its pool), "CPU", "DISK"; None: unsaid


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """A batch's timestamp and events; unknown event kinds are skipped (a newer vLLM may add some)."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        ts, raw_events = batch["ts"], batch["events"]
    else:
        ts, raw_events = batch[0], batch[1]
    events = [e for e in (_decode_event(r) for r in raw_events) if e is not None]
    return float(ts), events


def _decode_event(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    else:
        kind = raw[0]
        names = _STORED_FIELDS if kind == STORED else _REMOVED_FIELDS if kind == REMOVED else ()
        fields = dict(zip(names, raw[1:], strict=False))  # older vLLMs send fewer fields
    if kind == CLEARED:
        return KVEvent(CLEARED)
    if kind not in (STORED, REMOVED):
        return None
    hashes = [external_hash(h) for h in fields.get("block_hashes") or ()]
    medium = fields.get("medium")
    medium = medium if isinstance(medium, str) else None
    if kind == REMOVED:
        return KVEvent(REMOVED, hashes, medium=medium)
    return KVEvent(STORED, hashes, list(fields.get("token_ids") or ()), fields.get("block_size"),
                   fields.get("lora_name") or fields.get("lora_id"), medium)


def stored_event(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
                 medium: str = "GPU", lora_name: str | None = None) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM's msgspec struct encodes it (fields with defaults left out); ``medium`` is
    where the blocks are held ("GPU": the engine's pool, as vLLM names it whatever the device), ``lora_name``
    the adapter they were computed with (None: the base model)."""
    return {"type": STORED, "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora_name}


def removed_event(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": REMOVED, "block_hashes": hashes, "medium": medium}


def cleared_event() -> dict[str, Any]:
    return {"type": CLEARED}


def encode_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """An ``EventBatch`` in the maps form of current vLLM."""
    return msgpack.packb({"ts": ts, "events": events, "data_parallel_rank": data_parallel_rank}, use_bin_type=True)
