"""Which worker holds which KV blocks, keyed by the engine's chained block hashes.

Two kinds of entries per worker:
- *exact*: the hashes the worker reported itself through its KV events (stored / removed), reset
  from a snapshot whenever the worker (re)connects — a restarted worker starts empty again;
- *routed*: hashes of prompts the router sent to the worker, each expiring after a TTL and bounded
  by the worker's pool size (least recently routed dropped first). For the ``prefix`` policy they
  are the whole index (an approximation); for ``kv_aware`` they only bridge the moments between
  routing a prompt and the worker's ``stored`` events for it.

A worker holds a prefix of ``k`` blocks when its first ``k`` hashes are all present: the chain
makes a block's hash stand for every token before it.

Both kinds describe the worker's block pool (vLLM's medium ``"GPU"``). Blocks a worker reports in another
medium — its host memory (``"CPU"``) or disk (``"DISK"``) KV tier — are kept apart, per medium: such a
block is no pool hit but can be loaded instead of recomputed (:meth:`PrefixIndex.match_media`). A block in
a shared tier (``"SHARED"``: the Redis every worker of a model reads) is indexed once for the *scope* the
reporting worker names (its KV layout's namespace, :func:`fleetllm.kvtier.codec.namespace`): every worker of
that scope can load it, whichever wrote it, and it outlives the worker that reported it (the store does).
The scope's entries are a bounded LRU (:data:`SHARED_BLOCKS`): the store evicts by its own LRU and says
nothing, so the oldest reports are dropped first; a worker that finds a reported block gone removes it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

POOL = "GPU"  # vLLM's name for the medium of the engine's own block pool, whatever the device
SHARED = "SHARED"  # the medium of a KV tier every worker of one layout shares (fleetllm's Redis tier)
SHARED_BLOCKS = 1 << 18  # shared-tier hashes kept per scope (about 30 MB of index)


def is_pool(medium: str | None) -> bool:
    """Whether an event's ``medium`` is the block pool (events without one, from older vLLMs, are)."""
    return medium is None or medium.upper() == POOL


class PrefixIndex:
    def __init__(self, routed_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.routed_ttl_s = routed_ttl_s
        self.clock = clock
        self.exact: dict[str, set[int]] = {}
        self.routed: dict[str, OrderedDict[int, float]] = {}  # hash -> expiry, least recently routed first
        self.capacity: dict[str, int] = {}  # blocks a worker can hold (bounds its routed entries)
        self.tiers: dict[str, dict[str, set[int]]] = {}  # worker -> medium ("CPU", "DISK") -> hashes
        self.scopes: dict[str, str] = {}  # worker -> the scope its shared-tier blocks are indexed under
        self.shared: dict[str, OrderedDict[int, None]] = {}  # scope -> shared-tier hashes, least recent first

    # ---- updates ----------------------------------------------------------------------------------
    def reset(self, worker: str, hashes: Iterable[int], capacity: int | None = None) -> None:
        """Replace a worker's exact entries with a snapshot (after a (re)connect or restart); its tiers'
        entries are forgotten too (a snapshot, or vLLM's ``AllBlocksCleared``, starts the worker afresh)."""
        self.exact[worker] = set(hashes)
        self.tiers.pop(worker, None)
        if capacity:
            self.capacity[worker] = capacity

    def set_scope(self, worker: str, scope: str | None) -> None:
        """Index ``worker``'s shared-tier blocks under ``scope`` (None: as its own tier, shared with no one)."""
        if scope:
            self.scopes[worker] = scope
        else:
            self.scopes.pop(worker, None)

    def stored(self, worker: str, hashes: Iterable[int], medium: str | None = POOL) -> None:
        """``hashes`` entered ``worker``'s pool, or the tier called ``medium``."""
        if is_pool(medium):
            self.exact.setdefault(worker, set()).update(hashes)
        elif (shared := self._shared_of(worker, medium)) is not None:
            for h in hashes:
                shared[h] = None
                shared.move_to_end(h)
            while len(shared) > SHARED_BLOCKS:
                shared.popitem(last=False)
        else:
            self.tiers.setdefault(worker, {}).setdefault(medium.upper(), set()).update(hashes)

    def removed(self, worker: str, hashes: Iterable[int], medium: str | None = POOL) -> None:
        """``hashes`` left ``worker``'s pool (or the tier ``medium``: its pool entries stay as they are)."""
        if (shared := self._shared_of(worker, medium)) is not None:
            for h in hashes:
                shared.pop(h, None)
            return
        if not is_pool(medium):
            held = self.tiers.get(worker, {}).get(medium.upper())
            if held is not None:
                held.difference_update(hashes)
            return
        ex = self.exact.get(worker)
        routed = self.routed.get(worker)
        for h in hashes:
            if ex is not None:
                ex.discard(h)
            if routed is not None:
                routed.pop(h, None)  # evicted for real: a hint would now be a lie

    def record_routed(self, worker: str, hashes: Sequence[int], ttl_s: float | None = None) -> None:
        """Remember that ``hashes`` went to ``worker`` for ``ttl_s`` (default: the index's TTL)."""
        ttl = self.routed_ttl_s if ttl_s is None else ttl_s
        if not hashes or ttl <= 0 or self.routed_ttl_s <= 0:
            return
        entries = self.routed.setdefault(worker, OrderedDict())
        expiry = self.clock() + ttl
        for h in hashes:
            entries[h] = expiry
            entries.move_to_end(h)
        cap = self.capacity.get(worker)
        while cap is not None and len(entries) > cap:
            entries.popitem(last=False)

    def drop(self, worker: str) -> None:
        """Forget everything about a worker (it died, or its event stream broke); a shared tier's blocks it
        reported stay (the store holds them, not the worker)."""
        self.exact.pop(worker, None)
        self.routed.pop(worker, None)
        self.tiers.pop(worker, None)
        self.scopes.pop(worker, None)

    def _shared_of(self, worker: str, medium: str | None) -> OrderedDict[int, None] | None:
        """The shared-tier entries of ``worker``'s scope when ``medium`` is the shared tier's (else None)."""
        scope = self.scopes.get(worker)
        if scope is None or medium is None or medium.upper() != SHARED:
            return None
        return self.shared.setdefault(scope, OrderedDict())

    def drop_exact(self, worker: str) -> None:
        self.exact.pop(worker, None)
        self.tiers.pop(worker, None)

    # ---- queries ----------------------------------------------------------------------------------
    def has(self, worker: str, h: int, now: float) -> bool:
        ex = self.exact.get(worker)
        if ex is not None and h in ex:
            return True
        routed = self.routed.get(worker)
        if routed is None:
            return False
        expiry = routed.get(h)
        if expiry is None:
            return False
        if expiry < now:
            del routed[h]
            return False
        return True

    def match(self, hashes: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of ``hashes`` it holds."""
        now = self.clock()
        depth = {w: 0 for w in workers}
        alive = list(depth)
        for i, h in enumerate(hashes):
            alive = [w for w in alive if self.has(w, h, now)]
            if not alive:
                break
            for w in alive:
                depth[w] = i + 1
        return depth

    def match_media(self, hashes: Sequence[int], workers: Iterable[str],
                    rank: Callable[[str], float] = lambda m: 0.0) -> dict[str, list[str]]:
        """For each worker, where it holds each leading block of ``hashes``: ``POOL``, or the medium of the
        tier it would load the block from (the lowest ``rank`` of those holding it). The list stops at the
        first block held nowhere; with no tier entries it is :meth:`match`'s depth of ``POOL``."""
        now = self.clock()
        out: dict[str, list[str]] = {}
        for w in workers:
            held: list[tuple[str, set[int] | OrderedDict[int, None]]] = list(self.tiers.get(w, {}).items())
            if (scope := self.scopes.get(w)) in self.shared:
                held.append((SHARED, self.shared[scope]))
            tiers = sorted(held, key=lambda kv: rank(kv[0]))
            media = out[w] = []
            for h in hashes:
                where = POOL if self.has(w, h, now) else next((m for m, held in tiers if h in held), None)
                if where is None:
                    break
                media.append(where)
        return out

    def size(self, worker: str) -> int:
        return len(self.exact.get(worker, ())) + len(self.routed.get(worker, ()))
