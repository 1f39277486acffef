"""The router's side of disaggregated serving: with the decode worker chosen, prefill elsewhere or not.

The decode worker is chosen first (by the router's policy); the prompt is prefilled remotely only when
that worker lacks at least ``pd_threshold`` of its tokens (with ``auto``: when the P/D path is expected to
cost less, see :mod:`fleetllm.disagg.pd_auto`) and some prefill worker has room (``prefill_max_inflight``);
of those, the one that would finish first, counting what it already holds of the prompt. The prefill worker
computes the KV and pushes it to the decode worker (``POST /pd/prefill``, see
:mod:`fleetllm.disagg.prefill_side`) with the prompt's first token, under a transfer id minted here. The
request goes to the decode worker at once, naming that id and how long to wait for it (headers
:data:`fleetllm.disagg.handoffs.HEADER`, :data:`~fleetllm.disagg.handoffs.WAIT_HEADER`): it waits there while
the prefill runs and streams the first token as soon as the handoff is committed, so neither this hop nor the
prefill worker's answer stands between the prefill and the first token. Whatever goes wrong on the remote leg
(prefill worker down, transfer refused, timeout), the router tells the decode worker (``POST /pd/abandon``)
and the request goes on there with a local prefill: counted, and invisible to the client. An attempt that
ends first (the client left, the decode worker failed) cancels the remote leg. Torch-free, like the rest of
the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import httpx

from fleetllm.disagg.handoffs import HEADER as HANDOFF_HEADER
from fleetllm.disagg.handoffs import WAIT_HEADER
from fleetllm.disagg.pd_auto import AUTO, ArrivalRates, PdEstimate, PdMeasurements
from fleetllm.router.adapters import serves
from fleetllm.router.forward import Forward
from fleetllm.router.index import PrefixIndex
from fleetllm.router.metrics import RouterMetrics
from fleetllm.router.policies import Decision, RouteRequest
from fleetllm.router.upstream import WorkerState

if TYPE_CHECKING:
    from fleetllm.router.gateway import RouterConfig

log = logging.getLogger(__name__)

HANDED_OVER = ("/v1/completions", "/v1/chat/completions")  # the endpoints whose requests wait for a handoff


class RemotePrefill:
    """Decides per request whether to prefill on a prefill worker, and does it."""

    def __init__(self, client: httpx.AsyncClient, cfg: RouterConfig, metrics: RouterMetrics,
                 events_index: PrefixIndex, on_failure: Callable[[WorkerState], None]) -> None:
        self.client = client
        self.cfg = cfg
        self.metrics = metrics
        self.events_index = events_index  # what each worker reported holding (KV events)
        self.on_failure = on_failure  # a prefill worker failed: its circuit breaker counts it
        self.measured = PdMeasurements(cfg.cost.prefill_tokens_per_s)  # what --pd-threshold auto decides on
        self.arrivals = ArrivalRates()  # requests/s routed to each worker, for auto's stall estimate
        self._legs: set[asyncio.Task[None]] = set()  # remote prefills under way (the loop keeps weak references)

    async def maybe_disaggregate(self, d: Decision, fwd: Forward, prefill_pool: list[WorkerState]) -> Decision:
        """``d``, with the remote prefill started when it is to be taken: then the headers naming its transfer
        and the prompt tokens its worker will find cached once it is done."""
        now = time.monotonic()
        arriving = self.arrivals.rate(d.worker.name, now)  # before this request: it delays nobody by itself
        self.arrivals.observe(d.worker.name, now)
        if fwd.path not in HANDED_OVER:
            return d
        d = self._with_reported_blocks(d, fwd.route)
        uncached = d.uncached_tokens(fwd.route)
        auto = self.cfg.pd_threshold == AUTO
        if uncached < (fwd.route.block_size if auto else int(self.cfg.pd_threshold)):
            self.metrics.pd_decisions.labels(decision="local").inc()
            return d
        choice = self._prefill_worker(prefill_pool, fwd.route, d.worker)
        if choice is None:
            self.metrics.pd_decisions.labels(decision="saturated").inc()
            return d
        p, computed = choice
        if auto and not self._wins(self.estimate(d.worker, p, uncached, computed, arriving)):
            self.metrics.pd_decisions.labels(decision="local").inc()
            return d
        transfer = uuid.uuid4().hex
        leg = asyncio.create_task(self._remote_leg(p, d.worker, fwd, computed, transfer))
        self._legs.add(leg)
        leg.add_done_callback(self._legs.discard)

        def ended(answered: bool) -> None:
            # unanswered (the client left, the decode worker failed): nobody waits for the KV any more;
            # answered: the decode worker has stopped waiting, and the leg's own answer is still to be counted
            if not answered:
                leg.cancel()

        headers = {HANDOFF_HEADER: transfer, WAIT_HEADER: f"{self.cfg.pd_timeout_s:g}"}
        cached = max(d.cached_tokens, fwd.route.num_prompt_tokens - 1)  # all but the first token, once handed over
        return Decision(d.worker, d.reason, cached, headers, ended)

    async def _remote_leg(self, p: WorkerState, decode: WorkerState, fwd: Forward, computed: int,
                          transfer: str) -> None:
        """Prefill on ``p`` into ``decode`` under ``transfer``; on failure, tell ``decode`` to prefill itself."""
        t0 = time.perf_counter()
        try:
            ok, detail, prefill_at_fault = await self._prefill(p, decode, fwd, computed, transfer)
        except asyncio.CancelledError:  # the attempt ended first: no request waits for this any more
            self.metrics.pd_decisions.labels(decision="cancelled").inc()
            raise
        if not ok:
            self.metrics.pd_decisions.labels(decision="fallback").inc()
            self.metrics.errors.labels(kind="pd_prefill_failed").inc()
            if prefill_at_fault:
                self.on_failure(p)
            log.warning("request %s: remote prefill on %s failed (%s); prefilling on %s", fwd.rid, p.name, detail,
                        decode.name)
            await self._abandon(decode, transfer)
            return
        p.breaker.success()
        self._learn(p, computed, detail, time.perf_counter() - t0)
        self.metrics.pd_decisions.labels(decision="disaggregated").inc()
        self.metrics.pd_seconds.observe(time.perf_counter() - t0)
        self.metrics.pd_bytes.inc(detail.get("bytes", 0))

    async def _abandon(self, decode: WorkerState, transfer: str) -> None:
        """The request waiting on ``decode`` for ``transfer`` prefills there now (else when its wait is over)."""
        try:
            await self.client.post(decode.url + "/pd/abandon", json={"transfer_id": transfer},
                                   timeout=self.cfg.connect_timeout_s + 5.0)
        except httpx.HTTPError as e:
            log.warning("could not tell %s to give up transfer %s (%s): its request waits out its wait",
                        decode.name, transfer, type(e).__name__)

    def estimate(self, decode: WorkerState, p: WorkerState, uncached: int, computed: int,
                 arrival_rate: float = 0.0) -> PdEstimate:
        """Both paths' costs for a prompt ``decode`` lacks ``uncached`` tokens of and ``p`` lacks ``computed``,
        with requests arriving at ``decode`` at ``arrival_rate`` per second."""
        m = self.measured
        rate_d, rate_p = m.rate(decode.name), m.rate(p.name)
        return PdEstimate(uncached_tokens=uncached, prefill_tokens=computed, decode_batch=_decoding(decode),
                          prefill_batch=_decoding(p) if p.role != "prefill" else 0,
                          decode_rate=rate_d, prefill_rate=rate_p, decode_queue_s=_queued_tokens(decode) / rate_d,
                          prefill_queue_s=_queued_tokens(p) / rate_p, transfer_s=m.transfer_s(uncached),
                          overhead_s=m.overhead_s, arrival_rate=arrival_rate)

    def _wins(self, est: PdEstimate) -> bool:
        """Whether the P/D path wins for ``est``; the decision and both sides of it are exported."""
        decision = "disaggregated" if est.disaggregate else "local"
        self.metrics.pd_auto.labels(decision=decision).inc()
        self.metrics.pd_estimate.labels(side="local_stall", decision=decision).observe(est.stall_s)
        self.metrics.pd_estimate.labels(side="remote", decision=decision).observe(est.remote_s)
        self.metrics.pd_estimate.labels(side="transfer", decision=decision).observe(est.transfer_s)
        return est.disaggregate

    def _learn(self, p: WorkerState, computed: int, detail: dict[str, Any], elapsed_s: float) -> None:
        self.measured.observe(p.name, computed, detail, elapsed_s)
        self.metrics.pd_prefill_rate.labels(worker=p.name).set(self.measured.rate(p.name))
        if self.measured.bandwidth:
            self.metrics.pd_bandwidth.set(self.measured.bandwidth)

    def _with_reported_blocks(self, d: Decision, req: RouteRequest) -> Decision:
        """``d``, crediting what the decode worker reported caching when the policy's view knew less."""
        held = self.events_index.match(req.hashes_for(d.worker), [d.worker.name])[d.worker.name] * req.block_size
        if held > d.cached_tokens:
            return Decision(d.worker, d.reason, min(held, max(req.num_prompt_tokens - 1, 0)))
        return d

    def _prefill_worker(self, prefill_pool: list[WorkerState], req: RouteRequest,
                        decode: WorkerState) -> tuple[WorkerState, int] | None:
        """The prefill worker with room that would finish this prompt first, by its queue and what it already
        holds of the prompt (a shared document is not prefilled twice); and the tokens it would compute."""
        now = time.monotonic()
        # a peer that also decodes (auto, no prefill workers) only while it has nothing decoding: its own
        # streams would stall as long as the decode worker's would have, and both tails would show it
        # an adapter's prompt only where the adapter is served (there its KV is computed with it), a copy that must
        # bring it into its step's tables first paying the router's price of that load (--lora-load-cost)
        free = [w for w in prefill_pool if w.routable(now) and w.inflight < self.cfg.prefill_max_inflight
                and w is not decode and (w.role == "prefill" or not _decoding(w)) and serves(w, req.lora_name)]
        if not free:
            return None
        held = self.events_index.match(req.block_hashes, [w.name for w in free])
        computed = {w.name: max(0, req.num_prompt_tokens - held[w.name] * req.block_size) for w in free}

        def finish_s(w: WorkerState) -> tuple[float, int]:
            load_s = self.cfg.cost.adapter_s(w, req.lora_name)
            return (_queued_tokens(w) + computed[w.name]) / self.measured.rate(w.name) + load_s, w.inflight

        p = min(free, key=finish_s)
        return p, computed[p.name]

    async def _prefill(self, p: WorkerState, decode: WorkerState, fwd: Forward, uncached: int,
                       transfer: str) -> tuple[bool, Any, bool]:
        """Ask ``p`` to prefill and ship to ``decode``: (ok, its answer or why not, whether ``p`` is to blame)."""
        via = self.cfg.pd_transfer
        if via == "auto":
            via = "shm" if _host(p.url) == _host(decode.url) else "http"
        p.inflight += 1
        p.pending_prefill_tokens += uncached
        try:
            r = await self.client.post(p.url + "/pd/prefill", json={
                "path": fwd.path, "body": fwd.body, "decode_url": decode.url, "transfer": via, "request_id": fwd.rid,
                "timeout_s": self.cfg.pd_timeout_s, "transfer_id": transfer}, headers={"x-request-id": fwd.rid},
                timeout=httpx.Timeout(self.cfg.pd_timeout_s, connect=self.cfg.connect_timeout_s))
            ok = r.status_code == 200
            detail = r.json() if ok else r.text[:200]
            # 502 = the prefill worker did its part but the decode worker refused or was unreachable; 4xx = the
            # request itself is bad (its parameters are checked there now): the decode worker will say so too
            return ok, detail, r.status_code >= 500 and r.status_code != 502
        except (httpx.HTTPError, ValueError) as e:
            return False, f"{type(e).__name__}: {e}", True
        finally:
            p.inflight -= 1
            p.pending_prefill_tokens -= uncached


def _decoding(w: WorkerState) -> int:
    """Requests decoding on ``w``: the router's count, or the worker's report of those past their prefill."""
    return max(w.decoding, w.running - (w.inflight - w.decoding))


def _queued_tokens(w: WorkerState) -> int:
    """Prompt tokens ahead of a new request on ``w``: the router's count or the worker's report, the larger."""
    return max(w.pending_prefill_tokens, w.queued_prefill_tokens)


def _host(url: str) -> str:
    h = urlparse(url).hostname or ""
    return "127.0.0.1" if h == "localhost" else h
