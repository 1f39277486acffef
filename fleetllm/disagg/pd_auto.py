"""``--pd-threshold auto``: per request, disaggregate only when it wins.

A local prefill of ``U`` uncached tokens on the decode worker takes ``T = U / R_d`` seconds (``R_d`` its
prefill rate). It stalls each of the ``B`` requests decoding there for about ``T``, and each request that
arrives meanwhile (at the worker's rate ``λ``, measured by the router: :class:`ArrivalRates`) waits behind it
for ``T / 2`` on average: ``B·T + λ·T²/2`` request-seconds of delay in all. The P/D path spares them that, but
costs the request itself its wait and compute on the prefill worker plus the transfer instead of its wait and
compute on the decode worker, and the decode worker still imports the frame (its streams, and arrivals, wait
out the transfer's import side, counted as the whole transfer time ``X``: the conservative side). So, in
request-seconds of delay added::

    local  = B · T + λ · T² / 2
    remote = B · X + λ · X² / 2 + B_p · U_p / R_p + max(0, (queue_p + U_p / R_p + X) − (queue_d + T))

(``B_p``: requests decoding on the prefill worker, 0 for a prefill-only one; with ``auto`` and no
prefill workers, any other worker of the model may prefill for the chosen one, and an idle one wins)
(the remote leg's fixed overhead, measured too, added to its TTFT) and the request goes the P/D way only
when ``remote < local``: never on an idle decode worker nobody is arriving at, never when moving the KV takes
longer than computing it there. Rates and bandwidth are measured from the remote prefills' answers
(:class:`PdMeasurements`); until a first transfer has been measured it counts as free, so the first long
prompt shows what a transfer costs. The simulated fleet (:mod:`fleetllm.sim.pd_fleet`) decides with the same
estimate and the same arrival measurement. Torch-free, like the rest of the router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

AUTO = "auto"
MIN_SAMPLE_TOKENS = 256  # a remote prefill shorter than this says more about overheads than about the rate
EWMA = 0.3  # weight of the newest measurement


@dataclass(frozen=True)
class PdEstimate:
    """What the router expects of one request's two paths (seconds, tokens, tokens/s)."""

    uncached_tokens: int  # the decode worker would compute these locally
    prefill_tokens: int  # the prefill worker would compute these (less what it already caches)
    decode_batch: int  # requests decoding on the decode worker now
    decode_rate: float  # the decode worker's prefill rate
    prefill_rate: float  # the prefill worker's prefill rate
    decode_queue_s: float  # before a local prefill would start
    prefill_queue_s: float  # before a remote prefill would start
    transfer_s: float  # moving (and importing) the KV of ``uncached_tokens``
    overhead_s: float = 0.0  # the remote leg's fixed cost: the round trips and the bookkeeping around them
    prefill_batch: int = 0  # requests decoding on the prefill worker (a peer that also decodes: it stalls too)
    arrival_rate: float = 0.0  # requests/s arriving at the decode worker (they queue behind whatever it computes)

    def _blocked_s(self, seconds: float) -> float:
        """Request-seconds of delay when the decode worker is busy for ``seconds``: its running requests the
        whole time, those arriving meanwhile half of it on average."""
        return self.decode_batch * seconds + self.arrival_rate * seconds * seconds / 2

    @property
    def stall_s(self) -> float:
        """Request-seconds of delay a local prefill adds to the decode worker's requests, running and arriving."""
        return self._blocked_s(self.uncached_tokens / self.decode_rate)

    @property
    def remote_s(self) -> float:
        """Request-seconds of delay the P/D path adds: the import's stall, and this request's longer wait."""
        local_ttft = self.decode_queue_s + self.uncached_tokens / self.decode_rate
        remote_ttft = self.prefill_queue_s + self.prefill_tokens / self.prefill_rate + self.transfer_s + self.overhead_s
        peer_stall = self.prefill_batch * self.prefill_tokens / self.prefill_rate
        return self._blocked_s(self.transfer_s) + peer_stall + max(0.0, remote_ttft - local_ttft)

    @property
    def disaggregate(self) -> bool:
        return self.remote_s < self.stall_s


def pd_threshold_value(text: str) -> int | str:
    """``--pd-threshold``'s value: a token count, or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--pd-threshold takes a token count or auto, not {text!r}") from None


@dataclass
class ArrivalRates:
    """Requests/s routed to each worker: a count that decays with time constant ``horizon_s`` (each arrival adds
    ``1 / horizon_s``), so a steady Poisson stream of rate λ reads λ after a horizon or two, and a burst fades."""

    horizon_s: float = 30.0
    _seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # worker -> (rate, when last updated)

    def observe(self, worker: str, now: float) -> None:
        """A request was routed to ``worker`` at ``now`` (seconds, any monotonic clock)."""
        self._seen[worker] = (self.rate(worker, now) + 1 / self.horizon_s, now)

    def rate(self, worker: str, now: float) -> float:
        """``worker``'s arrival rate as of ``now``; 0 for one nothing was routed to."""
        rate, then = self._seen.get(worker, (0.0, now))
        return rate * math.exp(-max(0.0, now - then) / self.horizon_s)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass
class PdMeasurements:
    """Prefill rates per worker, KV bytes per token and transfer bandwidth, from remote prefills' answers."""

    default_rate: float  # tokens/s before a worker's rate is measured (the cost model's, from the profile)
    rates: dict[str, float] = field(default_factory=dict)  # worker name -> measured prefill tokens/s
    bytes_per_token: float | None = None
    bandwidth: float | None = None  # bytes/s, prefill worker -> decode worker's pool
    overhead_s: float = 0.0  # what a remote leg took beyond its prefill and transfer

    def observe(self, prefill_worker: str, computed_tokens: int, answer: dict[str, Any], elapsed_s: float) -> None:
        """Learn from a successful ``/pd/prefill`` answer that took ``elapsed_s`` as the router waited for it;
        ``computed_tokens`` the prompt tokens the prefill worker did not hold."""
        prefill_s, transfer_s = float(answer.get("prefill_s") or 0), float(answer.get("transfer_s") or 0)
        self.overhead_s = _ewma(self.overhead_s or None, max(0.0, elapsed_s - prefill_s - transfer_s))
        nbytes, tokens = int(answer.get("bytes") or 0), int(answer.get("prompt_tokens") or 0)
        if computed_tokens >= MIN_SAMPLE_TOKENS and prefill_s > 0:
            self.rates[prefill_worker] = _ewma(self.rates.get(prefill_worker), computed_tokens / prefill_s)
        if nbytes > 0 and tokens > 0:
            self.bytes_per_token = _ewma(self.bytes_per_token, nbytes / tokens)
            if transfer_s > 0:
                self.bandwidth = _ewma(self.bandwidth, nbytes / transfer_s)

    def rate(self, worker: str) -> float:
        """``worker``'s measured prefill rate; else the mean measured one (same model), else the default."""
        if worker in self.rates:
            return self.rates[worker]
        return sum(self.rates.values()) / len(self.rates) if self.rates else self.default_rate

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move ``tokens`` of KV; 0 until a transfer has been measured."""
        if not self.bytes_per_token or not self.bandwidth:
            return 0.0
        return tokens * self.bytes_per_token / self.bandwidth
