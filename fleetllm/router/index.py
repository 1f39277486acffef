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
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


class PrefixIndex:
    def __init__(self, routed_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.routed_ttl_s = routed_ttl_s
        self.clock = clock
        self.exact: dict[str, set[int]] = {}
        self.routed: dict[str, OrderedDict[int, float]] = {}  # hash -> expiry, least recently routed first
        self.capacity: dict[str, int] = {}  # blocks a worker can hold (bounds its routed entries)

    # ---- updates ----------------------------------------------------------------------------------
    def reset(self, worker: str, hashes: Iterable[int], capacity: int | None = None) -> None:
        """Replace a worker's exact entries with a snapshot (after a (re)connect or restart)."""
        self.exact[worker] = set(hashes)
        if capacity:
            self.capacity[worker] = capacity

    def stored(self, worker: str, hashes: Iterable[int]) -> None:
        self.exact.setdefault(worker, set()).update(hashes)

    def removed(self, worker: str, hashes: Iterable[int]) -> None:
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
        """Forget everything about a worker (it died, or its event stream broke)."""
        self.exact.pop(worker, None)
        self.routed.pop(worker, None)

    def drop_exact(self, worker: str) -> None:
        self.exact.pop(worker, None)

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

    def size(self, worker: str) -> int:
        return len(self.exact.get(worker, ())) + len(self.routed.get(worker, ()))
