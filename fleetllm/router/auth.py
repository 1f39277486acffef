"""The router's key gate: who is calling, may they use this model, and are they within their limits.

Off unless the router has a keys file. With it: ``/v1/*`` needs ``Authorization: Bearer <key>`` (401
without a live key, 403 for a model the key may not use, 429 with ``Retry-After`` past a limit), and
a key marked ``admin`` opens ``/router/state`` and ``/admin/*`` as the admin token does. Usage (requests, prompt and
output tokens) is metered per key id. With ``--state-url`` the limits are counted in Redis, shared by every
router of the fleet (:mod:`fleetllm.router.shared_limits`). The key itself is never logged, counted or
forwarded: the router presents its own worker secret upstream instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from fleetllm.router.keys import KeyLimiter, KeyRecord, KeyStore, Refusal
from fleetllm.router.shared_limits import SharedLimiter
from fleetllm.server.protocol import APIError


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class KeyGate:
    store: KeyStore
    limiter: KeyLimiter
    registry: CollectorRegistry
    shared: SharedLimiter | None = None  # --state-url: limits counted in a store every router shares
    usage: dict[str, Usage] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.requests = Counter("fleetllm_key_requests", "Requests per API key id, by outcome (admitted, "
                                "unauthorized, forbidden, limited).", ["key", "outcome"], registry=self.registry)
        self.tokens = Counter("fleetllm_key_tokens", "Tokens per API key id (kind: prompt | completion).",
                              ["key", "kind"], registry=self.registry)

    @staticmethod
    def bearer(authorization: str | None) -> str | None:
        if authorization and authorization[:7].lower() == "bearer ":
            return authorization[7:].strip()
        return None

    def authenticate(self, authorization: str | None) -> KeyRecord | None:
        """The live key an ``Authorization`` header carries, or None."""
        return self.store.authenticate(self.bearer(authorization))

    def require_live(self, authorization: str | None) -> KeyRecord:
        """The live key an ``Authorization`` header carries; a 401 ``APIError`` (counted) when it carries none."""
        rec = self.authenticate(authorization)
        if rec is None:
            self.requests.labels(key="none", outcome="unauthorized").inc()
            raise APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`")
        return rec

    def identify(self, authorization: str | None, model: str | None) -> KeyRecord:
        """The caller's key record, allowed ``model``; raises a 401 / 403 ``APIError`` (limits not checked)."""
        return self._allowed(self.require_live(authorization), model)

    def identify_id(self, key_id: str, model: str | None) -> KeyRecord:
        """The live key with id ``key_id`` (a batch's owner, checked again as each of its lines runs),
        allowed ``model``; raises a 401 / 403 ``APIError``."""
        rec = next((r for r in self.store.records() if r.id == key_id and not r.revoked), None)
        if rec is None:
            self.requests.labels(key="none", outcome="unauthorized").inc()
            raise APIError(401, f"key {key_id} is revoked or gone")
        return self._allowed(rec, model)

    def _allowed(self, rec: KeyRecord, model: str | None) -> KeyRecord:
        if not rec.allows(model):
            self.requests.labels(key=rec.id, outcome="forbidden").inc()
            raise APIError(403, f"key {rec.id} may not use model `{model}`", "model")
        return rec

    async def limit(self, rec: KeyRecord) -> Refusal | None:
        """Count one request of ``rec`` against its limits (shared by every router with a state store);
        the refusal when one is reached (nothing counted then)."""
        refusal = await self.shared.admit(rec) if self.shared is not None else self.limiter.admit(rec)
        return self._counted(rec, refusal)

    def admit(self, authorization: str | None, model: str | None) -> KeyRecord:
        """The caller's key record, its request counted by this router alone; raises a 401 / 403 / 429."""
        rec = self.identify(authorization, model)
        refusal = self._counted(rec, self.limiter.admit(rec))
        if refusal is not None:
            raise self.refusal_error(refusal)
        return rec

    def _counted(self, rec: KeyRecord, refusal: Refusal | None) -> Refusal | None:
        if refusal is not None:
            self.requests.labels(key=rec.id, outcome="limited").inc()
            return refusal
        self.requests.labels(key=rec.id, outcome="admitted").inc()
        self.usage.setdefault(rec.id, Usage()).requests += 1
        return None

    @staticmethod
    def refusal_error(refusal: Refusal) -> APIError:
        """A refusal as the client's error, with ``Retry-After`` in whole seconds."""
        retry = str(max(1, int(refusal.retry_after + 0.999))) if refusal.retry_after is not None else "1"
        return APIError(refusal.status, refusal.message, headers={"Retry-After": retry})

    def done(self, rec: KeyRecord, prompt_tokens: int, completion_tokens: int) -> None:
        """A request of ``rec`` ended: free its parallel slot and meter its tokens."""
        (self.shared or self.limiter).done(rec, prompt_tokens + completion_tokens)
        u = self.usage.setdefault(rec.id, Usage())
        u.prompt_tokens += prompt_tokens
        u.completion_tokens += completion_tokens
        self.tokens.labels(key=rec.id, kind="prompt").inc(prompt_tokens)
        self.tokens.labels(key=rec.id, kind="completion").inc(completion_tokens)
