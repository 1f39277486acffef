"""Routing policies: each picks one worker for a request and says why.

Every policy implements :class:`Policy` and is registered by name in ``POLICIES``. Reasons (the
``reason`` label of the decision counter):

- ``affinity``  the worker that already holds the most of this request's prefix (or its session)
- ``spill``     another worker was chosen although one held more of the prefix / owned the session,
                because the affine one was too loaded
- ``cold``      no worker holds any of the prefix: chosen by load alone
- ``balance``   a load-only policy's choice (round_robin, least_load)
- ``fallback``  the policy lacked what it needs (no session key, no tokens): least load instead
- ``retry``     a second or later attempt after a failure before the first byte (set by the gateway)

The cost used by ``prefix`` and ``kv_aware`` is in estimated seconds (docs/architecture.md, "Routing cost"):
``queue + this request's uncached tokens / prefill_rate + γ · decoding / decode_rate + KV-pressure
penalty``, ties broken at random, over the workers whose in-flight count stays within ``balance`` times
the mean (bounded load, as in the session policy). The queue is the time before this request's prefill
would start: the prompt tokens queued ahead of it at the prefill rate, plus a step's share for each
request queued ahead (:meth:`CostModel.queue_s`). Because a holder's queue is weighed against the
prefix it saves, a new session of a hot prefix spills to another worker (which then computes and
caches the prefix: a second replica) as soon as waiting at the holders costs more than recomputing.

A prefix block a worker holds in a KV tier rather than its pool (host memory, disk: its KV events say the
medium; or the shared tier every worker of its layout reads, whichever worker reported the block) is neither free nor a miss: it costs :attr:`CostModel.tier_load` (a fraction of recomputing it)
of a block's prefill — ``uncached`` in the cost counts such a block as that fraction of its tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from fleetllm.errors import UsageError
from fleetllm.router.index import POOL, SHARED, PrefixIndex, is_pool

if TYPE_CHECKING:  # httpx, which upstream imports, is no part of a worker's start (the CLI imports this module)
    from collections.abc import Callable

    from fleetllm.router.upstream import WorkerState


@dataclass
class RouteRequest:
    """What a policy may look at: the prompt's tokens and block hashes (when the router could
    tokenize it), its length, and a session key."""

    num_prompt_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    block_size: int = 16
    session_key: str | None = None
    lora_name: str | None = None  # the LoRA adapter the request names (None: the base model)
    scheme_hashes: dict[str, list[int]] = field(default_factory=dict)  # other engines' hashes (vLLM's), by scheme

    def hashes_for(self, w: WorkerState) -> list[int]:
        """The prompt's block hashes as ``w``'s index entries are keyed."""
        return self.scheme_hashes.get(w.hash_scheme, []) if w.hash_scheme else self.block_hashes


@dataclass
class Decision:
    worker: WorkerState
    reason: str
    cached_tokens: int = 0  # the router's estimate of this request's prefix hit on ``worker``
    headers: dict[str, str] = field(default_factory=dict)  # sent to ``worker`` only (a P/D handoff's id)
    on_end: Callable[[bool], None] | None = None  # once the attempt on ``worker`` ended: whether it answered

    def uncached_tokens(self, req: RouteRequest) -> int:
        return max(0, req.num_prompt_tokens - self.cached_tokens)


@dataclass
class CostModel:
    """Seconds a worker would take to start this request; calibrated rates come from a profile."""

    prefill_tokens_per_s: float = 1000.0
    decode_tokens_per_s: float = 50.0  # one running stream's share of a step, in steps per second
    gamma: float = 1.0
    kv_high: float = 0.8  # above this KV usage a worker is penalised, up to kv_penalty_s at 100%
    kv_penalty_s: float = 2.0
    # Loading a block from a worker's KV tier, as a fraction of recomputing it (by the tier's medium in the
    # workers' KV events). A medium not named here is priced as a miss.
    tier_load: dict[str, float] = field(default_factory=lambda: {"CPU": 0.05, "DISK": 0.15, SHARED: 0.25})
    # A copy that does not hold a request's LoRA adapter resident: the seconds its load costs there, and the
    # adapter it evicts costs that copy's own requests later (fleetllm/router/adapters.py)
    lora_load_s: float = 0.5

    def with_tier_load(self, fractions: dict[str, str]) -> CostModel:
        """This model with ``fractions`` (``--kv-tier-load MEDIUM=FRACTION``) replacing its tiers' prices."""
        load = dict(self.tier_load)
        for medium, text in fractions.items():
            try:
                value = float(text)
            except ValueError:
                value = -1.0
            if not 0.0 <= value <= 1.0 or is_pool(medium):
                raise UsageError(f"--kv-tier-load {medium}={text}: a tier's medium (CPU, DISK, SHARED) and a fraction of "
                                 "recomputing, 0 to 1")
            load[medium.upper()] = value
        return replace(self, tier_load=load)

    def load_fraction(self, medium: str) -> float:
        """What a block held in ``medium`` costs, as a fraction of recomputing it (0 in the pool)."""
        return 0.0 if medium == POOL else min(1.0, self.tier_load.get(medium, 1.0))

    def cost(self, w: WorkerState, uncached: float, lora_name: str | None = None) -> float:
        """Seconds until ``w`` would have computed a request's ``uncached`` prompt tokens (a fraction of a token
        each for those it would load from a KV tier), with its LoRA adapter ``lora_name`` loaded first if ``w``
        does not hold it."""
        prefill = uncached / self.prefill_tokens_per_s
        decode = self.gamma * max(w.decoding, w.running - _pending(w)) / self.decode_tokens_per_s
        pressure = self.kv_penalty_s * max(0.0, w.kv_usage - self.kv_high) / (1.0 - self.kv_high)
        adapter = 0.0 if lora_name is None or lora_name in w.resident_adapters else self.lora_load_s
        return self.queue_s(w) + prefill + decode + pressure + adapter

    def queue_s(self, w: WorkerState) -> float:
        """Seconds before a request sent to ``w`` now would start its prefill.

        The router's own counts (what it dispatched and has no first byte for) and the worker's report
        (refreshed every event interval, and covering requests other routers sent) describe mostly the same
        requests, so the larger of each is taken rather than their sum. Each queued request also costs a
        step's per-sequence share while it is admitted ahead of this one."""
        tokens = max(w.pending_prefill_tokens, w.queued_prefill_tokens)
        requests = max(_pending(w), w.waiting)
        return tokens / self.prefill_tokens_per_s + requests / self.decode_tokens_per_s


def _pending(w: WorkerState) -> int:
    return w.inflight - w.decoding


class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, workers: list[WorkerState]) -> Decision:
        """Pick one of ``workers`` (non-empty, all routable)."""
        ...


def _least_loaded(workers: list[WorkerState], rng: random.Random) -> WorkerState:
    best = min((w.inflight, w.pending_prefill_tokens) for w in workers)
    return rng.choice([w for w in workers if (w.inflight, w.pending_prefill_tokens) == best])


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: RouteRequest, workers: list[WorkerState]) -> Decision:
        w = workers[self._next % len(workers)]
        self._next += 1
        return Decision(w, "balance")


class LeastLoad:
    """Fewest requests in flight (counted at dispatch), then fewest queued prefill tokens."""

    name = "least_load"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, req: RouteRequest, workers: list[WorkerState]) -> Decision:
        return Decision(_least_loaded(workers, self.rng), "balance")


class Session:
    """Consistent hashing of the session key with bounded load (Mirrokni et al.): walk the ring from
    the key's point to the first worker whose in-flight count stays within ``c`` times the mean.
    Adding or removing a worker moves only the sessions that hashed to it."""

    name = "session"

    def __init__(self, c: float = 1.25, vnodes: int = 64, seed: int | None = None) -> None:
        self.c = c
        self.vnodes = vnodes
        self.rng = random.Random(seed)
        self._ring: list[tuple[int, str]] = []
        self._ring_names: frozenset[str] = frozenset()

    @staticmethod
    def _point(s: str) -> int:
        return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")

    def _build(self, names: frozenset[str]) -> None:
        self._ring = sorted((self._point(f"{n}#{i}"), n) for n in names for i in range(self.vnodes))
        self._ring_names = names

    def choose(self, req: RouteRequest, workers: list[WorkerState]) -> Decision:
        if req.session_key is None:
            return Decision(_least_loaded(workers, self.rng), "fallback")
        by_name = {w.name: w for w in workers}
        names = frozenset(by_name)
        if names != self._ring_names:
            self._build(names)
        bound = math.ceil(self.c * (sum(w.inflight for w in workers) + 1) / len(workers))
        start = bisect.bisect(self._ring, (self._point(req.session_key), ""))
        owner = None
        for k in range(len(self._ring)):
            w = by_name[self._ring[(start + k) % len(self._ring)][1]]
            if owner is None:
                owner = w
            if w.inflight + 1 <= bound:
                return Decision(w, "affinity" if w is owner else "spill")
        return Decision(owner, "affinity")  # unreachable: the least loaded worker is always within bound


class PrefixAware:
    """Cheapest worker by the cost model, counting as cached the prefix the index says it holds.

    ``prefix`` uses an index of what the router itself routed (TTL'd); ``kv_aware`` the same class
    over an index kept exact by the workers' KV events (see :mod:`fleetllm.router.index`)."""

    def __init__(self, name: str, index: PrefixIndex, cost: CostModel | None = None, seed: int | None = None,
                 balance: float = 1.25) -> None:
        self.name = name
        self.index = index
        self.cost = cost or CostModel()
        self.rng = random.Random(seed)
        self.balance = balance

    def choose(self, req: RouteRequest, workers: list[WorkerState]) -> Decision:
        if not req.block_hashes and not req.scheme_hashes and req.num_prompt_tokens == 0 and req.lora_name is None:
            return Decision(_least_loaded(workers, self.rng), "fallback")
        media: dict[str, list[str]] = {}  # per worker, where it holds each leading block (pool or a tier)
        for scheme in {w.hash_scheme for w in workers}:  # one lookup per way of hashing (fleetllm's, vLLM's)
            same = [w for w in workers if w.hash_scheme == scheme]
            media.update(self.index.match_media(req.hashes_for(same[0]), [w.name for w in same],
                                                self.cost.load_fraction))
        depth = {name: len(m) for name, m in media.items()}
        best_depth = max(depth.values(), default=0)
        # Bounded load: a worker already above `balance` x the mean in-flight count takes no more until
        # the others catch up, however much of the prefix it holds (a hot prefix spills instead of
        # piling onto one replica). The least loaded worker always qualifies.
        bound = math.ceil(self.balance * (sum(w.inflight for w in workers) + 1) / len(workers))
        # A LoRA adapter's holders stay eligible past the bound: sending its request elsewhere costs a load there and
        # evicts another adapter (whose requests then miss in turn); the cost model weighs their queue against it.
        eligible = [w for w in workers if w.inflight + 1 <= bound or req.lora_name in w.resident_adapters] or workers
        costs = []
        for w in eligible:
            bs = w.block_size or req.block_size
            cached = min(depth[w.name] * bs, max(req.num_prompt_tokens - 1, 0))
            loaded = bs * sum(self.cost.load_fraction(m) for m in media[w.name])  # tier blocks: a load each
            costs.append((self.cost.cost(w, req.num_prompt_tokens - cached + loaded, req.lora_name), w, cached))
        low = min(c for c, _, _ in costs)
        ties = [(w, cached) for c, w, cached in costs if c <= low + 1e-9]
        w, cached = self.rng.choice(ties)
        if best_depth == 0:
            reason = "cold"
        elif depth[w.name] == best_depth:
            reason = "affinity"
        else:
            reason = "spill"
        return Decision(w, reason, cached)


POLICY_NAMES = ("round_robin", "least_load", "session", "prefix", "kv_aware")


def make_policy(name: str, index: PrefixIndex, cost: CostModel | None = None, seed: int | None = None) -> Policy:
    """The policy called ``name`` (one of ``POLICY_NAMES``)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad(seed)
    if name == "session":
        return Session(seed=seed)
    if name in ("prefix", "kv_aware"):
        return PrefixAware(name, index, cost, seed)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
