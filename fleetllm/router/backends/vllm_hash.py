"""vLLM's prefix-cache block hashes, computed the way vLLM computes them, so the router's index and a vLLM
worker's KV events name the same blocks.

vLLM (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``) chains each full block's hash on the one
before: ``H((parent_digest, tuple(block_token_ids), extra_keys))``, where the first block's parent is
``NONE_HASH = H(PYTHONHASHSEED)`` (a random 32 bytes when the variable is unset: then no one outside the
process can reproduce the chain) and ``H`` is the ``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``):
``sha256`` (the default: SHA-256 of the pickle of the tuple, highest protocol) or ``sha256_cbor`` (SHA-256
of its canonical CBOR). Plain-text prompts without LoRA, multimodal inputs or ``cache_salt`` have no extra
keys (``None``). KV events carry each digest's low 64 bits as an integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
on by default) or the raw digest; :func:`external_hash` maps either to the integer the index keys on.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

ALGOS = ("sha256", "sha256_cbor")
_MASK64 = (1 << 64) - 1


def _sha256_pickle(obj: Any) -> bytes:
    # The pickle is only ever produced here, never loaded: it is the byte string vLLM hashes.
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor(obj: Any) -> bytes:
    """Canonical CBOR of the few types a block key holds: str, bytes, non-negative ints, tuples, None."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(_cbor(x) for x in obj)
    raise TypeError(f"no CBOR encoding here for {type(obj).__name__}")


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head with the shortest argument (canonical form)."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError("integer too large for CBOR")


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(_cbor(obj)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def external_hash(h: bytes | int) -> int:
    """A block hash as vLLM's events carry it (an int, or the raw digest) as the router's index key."""
    return int.from_bytes(h, "big") & _MASK64 if isinstance(h, (bytes, bytearray)) else h & _MASK64


class VllmHasher:
    """Block hashes of a vLLM fleet: hash algorithm, ``PYTHONHASHSEED`` and block size as the workers have them."""

    def __init__(self, algo: str = "sha256", seed: str = "0", block_size: int = 16) -> None:
        if algo not in HASH_FUNCTIONS:
            raise ValueError(f"unsupported vLLM prefix-caching hash algorithm {algo!r}; one of {', '.join(ALGOS)}")
        self.fn = HASH_FUNCTIONS[algo]
        self.block_size = block_size
        self.key = f"vllm:{algo}:{seed}:{block_size}"  # workers sharing it share one hash list per request
        self.none_hash = self.fn(seed)

    def digest(self, parent: bytes | None, token_ids: Sequence[int], lora_name: str | None = None) -> bytes:
        """One block's full digest (vLLM chains on the full digest, not on the 64-bit event value); a block
        computed with an adapter has vLLM's extra keys ``(lora_name,)``."""
        return self.fn((parent or self.none_hash, tuple(token_ids), None if lora_name is None else (lora_name,)))

    def digests(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[bytes]:
        out: list[bytes] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.digest(parent, token_ids[start : start + bs], lora_name)
            out.append(parent)
        return out

    def hashes(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[int]:
        """Every full block's hash as vLLM's KV events name it (for a request run with adapter ``lora_name``)."""
        return [external_hash(d) for d in self.digests(token_ids, lora_name)]
