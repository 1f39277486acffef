"""Analytic fleet latency for a candidate at a request rate: fast enough to score every candidate.

Per decode replica, a mean-value fixed point: ``n`` sequences run; a decode step over them takes
``step(n)``; prefill chunks of arriving prompts share steps with those decodes and stretch the mean gap
between tokens to ``step(n) / (1 − ρ_prefill)``; a request holds a batch slot for its prefill and its
output, ``S``; Little's law gives ``n = λ·S`` (capped by the batch limit and by the KV cache). Requests
beyond the slots wait: Erlang C over ``c`` slots (pooled across replicas when routing balances load,
per replica for round robin), whose waiting time is exponential past the queueing probability.
ITL p99 is over requests (bench's per-request mean chunk gap): a request's gaps are stretched by the
prefill chunks that land during its decode, a Poisson count. P/D moves long uncached prompts to a
prefill pool (its own Erlang C) and adds the KV transfer and the decode replica's import (exposed after
the prefill; on a CPU worker also the steps' time it takes, which stretches the gap as prefill chunks do).
"""

from __future__ import annotations

import math

from fleetllm.recommend.candidate import Candidate, Prediction
from fleetllm.recommend.kv_import import frame_import
from fleetllm.recommend.perf_model import StepModel, prefill_seconds
from fleetllm.recommend.workload import WorkloadShape

AFFINITY_POLICIES = ("kv_aware", "prefix", "session")
LOOPBACK_GBS = 1.0  # KV frames between processes on one machine (HTTP on loopback)


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits, ``c`` servers, offered load ``a`` (< c) erlangs."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
        if b < 1e-12 and k > a:  # Erlang B only falls from here on: no one waits
            return 0.0
    rho = a / c
    return b / (1 - rho * (1 - b))


def wait_quantile(c: int, lam: float, service_s: float, q: float) -> float:
    """The ``q`` quantile of the waiting time in an M/M/c queue (inf when saturated)."""
    a = lam * service_s
    if a >= c:
        return math.inf
    p_wait = erlang_c(c, a)
    if p_wait <= 1 - q:
        return 0.0
    return math.log(p_wait / (1 - q)) / (c / service_s - lam)


def prefill_wait(rho: float, prefill_s: float, q: float) -> float:
    """The ``q`` quantile of the wait behind other prompts' prefills (M/D/1: mean ρ·P / 2(1−ρ), waiting with
    probability ρ, exponential past it)."""
    if rho <= 1 - q:
        return 0.0
    mean = rho * prefill_s / (2 * (1 - rho))
    return mean / rho * math.log(rho / (1 - q))


def _decode_point(c: Candidate, step: StepModel, w: WorkloadShape, lam: float, uncached: float,
                  local: float, batch: float) -> tuple[float, ...]:
    """Fixed point of one decode replica: (n, decode step, prefill time, prefill steps, extra, ρ_prefill, S)."""
    ctx = w.isl_mean + w.osl_mean / 2
    width = c.spec.verify_width(w.category)
    al = c.spec.acceptance_length(w.category)
    n = min(batch, max(1.0, lam * (uncached / 1000 + w.osl_mean) * step.step_seconds(width, 0, int(ctx))))
    for _ in range(25):
        m = max(1, round(n))
        dec = step.step_seconds(m * width, 0, int(m * ctx)) * (1 + c.spec.draft_cost())
        pf, pf_steps = prefill_seconds(step, int(uncached), c.chunk, m * width, int(m * ctx))
        extra = max(0.0, pf - pf_steps * dec)
        rho_p = lam * local * extra
        if rho_p >= 1:
            return n, dec, pf, pf_steps, extra, rho_p, math.inf
        tpot = dec / (1 - rho_p) / al
        service = pf + w.osl_mean * tpot
        target = min(batch, max(1.0, lam * service))
        if abs(target - n) < max(0.5, 0.03 * n):
            break
        n = 0.5 * n + 0.5 * target
    return n, dec, pf, pf_steps, extra, rho_p, service


def predict(c: Candidate, step: StepModel, w: WorkloadShape, rate: float, kv_tokens: int) -> Prediction:
    """Latency and throughput of candidate ``c`` at ``rate`` requests/s (analytic)."""
    hit = w.hit_fraction(c.routing in AFFINITY_POLICIES, c.replicas)
    remote = w.fraction_at_least(c.pd_threshold, hit) if c.prefill_replicas else 0.0
    batch = min(c.max_batch, kv_tokens / max(1.0, w.isl_mean + w.osl_mean))
    if batch < 1:
        return _infeasible(step, 9.9)
    lam = rate / c.replicas
    uncached = w.isl_mean * (1 - hit)
    n, dec, pf, pf_steps, extra, rho_p, service = _decode_point(c, step, w, lam, uncached, 1 - remote, batch)
    al = c.spec.acceptance_length(w.category)
    if not math.isfinite(service):
        return _infeasible(step, rho_p)
    pooled = c.routing != "round_robin"
    slots, arrivals = (int(batch) * c.replicas, rate) if pooled else (int(batch), lam)
    rho = arrivals * service / slots
    busy = rho_p + _import_share(c, step, w, lam * remote, hit)
    if busy >= 1:
        return _infeasible(step, busy)
    gap = dec / (1 - busy)
    m = max(1, round(n))
    ctx = int(m * (w.isl_mean + w.osl_mean / 2))
    width = c.spec.verify_width(w.category)
    ttft = {q: step.request_overhead_s + wait_quantile(slots, arrivals, service, q / 100) + prefill_wait(rho_p, pf, q / 100)
            + prefill_seconds(step, int(w.isl_pct(q) * (1 - hit)), c.chunk, m * width, ctx)[0] for q in (50, 90)}
    util = max(rho, rho_p)
    if c.prefill_replicas and remote > 0:
        ttft, util = _with_prefill_pool(c, step, w, rate * remote, hit, ttft, util, dec)
    life = w.osl_mean / al * gap
    landing = lam * (1 - remote) * pf_steps * life
    k99 = landing + 2.33 * math.sqrt(landing)
    per_step = extra / max(pf_steps, 1)
    steps = max(1.0, w.osl_mean / al)
    itl99 = dec + k99 * per_step / steps
    tpot = gap / al
    rel = (0.12 if step.measured else 0.25) + 0.5 * max(0.0, util - 0.7)
    return Prediction(
        ttft_p50_ms=ttft[50] * 1e3, ttft_p90_ms=ttft[90] * 1e3, itl_p50_ms=gap * 1e3, itl_p99_ms=max(itl99, gap) * 1e3,
        e2e_p90_s=ttft[90] + w.osl_pct(90) * tpot, output_tps=rate * w.osl_mean, tps_per_user=1 / tpot,
        utilization=util, rel_error=rel, measured=step.measured,
        extra={"running_per_replica": n, "prefix_hit": hit, "acceptance_length": al, "batch_limit": batch})


def _with_prefill_pool(c: Candidate, step: StepModel, w: WorkloadShape, rate: float, hit: float,
                       ttft: dict[int, float], util: float, dec: float) -> tuple[dict[int, float], float]:
    """TTFT of the long prompts sent to the prefill pool (queue, prefill alone, KV transfer and the decode
    replica's import of it, first decode)."""
    isl = w.mean_isl_at_least(c.pd_threshold, hit)
    uncached = int(isl * (1 - hit))
    service = prefill_seconds(step, uncached, c.chunk)[0]
    last_chunk = uncached - (math.ceil(uncached / c.chunk) - 1) * c.chunk if uncached > 0 else 0
    imported = frame_import(step).exposed(int(isl), step.step_seconds(0, last_chunk))
    transfer = kv_transfer_seconds(c, step, isl) + imported
    rho = rate * service / c.prefill_replicas
    out = {}
    for q in (50, 90):
        long = wait_quantile(c.prefill_replicas, rate, service, q / 100) + service + transfer + dec
        out[q] = max(ttft[q], long) if q == 90 else ttft[q]
    return out, max(util, rho)


def _import_share(c: Candidate, step: StepModel, w: WorkloadShape, lam_remote: float, hit: float) -> float:
    """Share of a decode replica's time its steps lose to importing the KV of ``lam_remote`` prompts/s."""
    if not lam_remote or not step.kv_import.steal:
        return 0.0
    isl = w.mean_isl_at_least(c.pd_threshold, hit)
    return lam_remote * step.kv_import.steal * frame_import(step).seconds(int(isl))


def kv_transfer_seconds(c: Candidate, step: StepModel, tokens: float) -> float:
    """Seconds to move ``tokens`` of KV from a prefill to a decode replica: EFA between instances,
    NVLink/PCIe within one, loopback HTTP on this machine. Infinite between instances whose network the
    catalogue does not give (``network_gbps: 0``, e.g. ``local-cpu``): such a P/D split can't be costed."""
    gbs = c.instance.network_gbps / 8 if c.instances > 1 else (c.instance.interconnect_gbs or LOOPBACK_GBS)
    if gbs <= 0:
        return math.inf
    return getattr(step, "kv_bytes_per_token", 0.0) * tokens / (gbs * 1e9)


def _infeasible(step: StepModel, util: float) -> Prediction:
    inf = math.inf
    return Prediction(inf, inf, inf, inf, inf, 0.0, 0.0, max(util, 1.0), 1.0, step.measured)


def meets(p: Prediction, slos: dict[str, float]) -> bool:
    """Whether every SLO (``ttft_p90_ms``, ``itl_p99_ms``, ``e2e_p90_s``, ...) holds at the point estimate."""
    return p.feasible and all(getattr(p, k) <= v for k, v in slos.items())


def capacity(c: Candidate, step: StepModel, w: WorkloadShape, kv_tokens: int, slos: dict[str, float],
             start: float) -> float:
    """The highest request rate at which ``c`` still meets ``slos`` (0 if none)."""
    def ok(r: float) -> bool:
        return meets(predict(c, step, w, r, kv_tokens), slos)

    lo, hi = 0.0, max(start, 1e-3)
    while ok(hi) and hi < 1e6:
        lo, hi = hi, hi * 2
    if lo == 0.0:
        hi_ok = hi
        while not ok(hi_ok) and hi_ok > 1e-4:
            hi_ok /= 2
        if not ok(hi_ok):
            return 0.0
        lo, hi = hi_ok, hi_ok * 2
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
