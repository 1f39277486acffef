"""The fleet in virtual time: the real engine (scheduler, block pool, prefix cache) per replica over a
step model, routed like the router does, with no sleeping, so a candidate's minutes of traffic take
seconds.

Each replica is an :class:`fleetllm.engine.engine.LLMEngine` over a :class:`VirtualExecutor` (the
simulated worker's timing executor whose step reports its duration instead of sleeping). Events run
in time order: an arrival is routed and queued at its time; otherwise the replica whose step ends
first takes its next step. Prompts are token ids built so that shared system prompts and a session's
history really are common prefixes: the prefix cache's hits are the engine's own. A session's next
turn is sent when its last one ends (as ``fleetllm bench`` sends them), its prompt the whole history. A P/D
split prefills long prompts on its prefill replicas and pays the KV transfer and the decode replica's import
of it (:class:`_Fleet`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fleetllm.engine.block_pool import hash_prefix_blocks
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.executor import ModelOutput, Sampled
from fleetllm.engine.params import SamplingParams
from fleetllm.engine.scheduler import SchedulerOutput
from fleetllm.recommend.candidate import Candidate, Prediction
from fleetllm.recommend.kv_import import FrameImport, ImportLoad, frame_import, import_window
from fleetllm.recommend.perf_model import StepModel
from fleetllm.recommend.queueing import kv_transfer_seconds
from fleetllm.recommend.speculation import Speculation
from fleetllm.recommend.workload import WorkloadShape
from fleetllm.router.config import RouterConfig
from fleetllm.sim.executor import SimulatedModel, TimingExecutor
from fleetllm.sim.profile import TimingProfile

BLOCK = 16
MAX_BLOCKS = 65536
VOCAB_FLOOR = 100  # token ids below this are left to special tokens


class VirtualExecutor(TimingExecutor):
    """A timing executor that sleeps for nothing: ``last_step_s`` says how long the step took."""

    def __init__(self, model: SimulatedModel, step: StepModel, num_blocks: int, spec: Speculation = Speculation(),
                 category: str = "chat") -> None:
        super().__init__(model, step, num_blocks)  # type: ignore[arg-type]  # same step_seconds signature
        # Speculation: each decode verifies ``width`` positions (k+1 where it drafts) and keeps ``acceptance``
        # tokens on average; the simulated request gets one token per step, so its decode share of the step is
        # divided by it.
        self.width = spec.verify_width(category)
        self.draft = spec.draft_cost()
        self.acceptance = spec.acceptance_length(category)
        self.last_step_s = 0.0

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        batch = sched.scheduled
        decode = [s for s in batch if s.seq.output_token_ids and s.num_new_tokens == 1]
        context = sum(s.seq.num_computed_tokens for s in decode)
        prefill = sched.num_tokens - len(decode)
        n = len(decode) * self.width
        dt = self.profile.step_seconds(n, prefill, context) * (1 + self.draft)
        if decode and self.acceptance != 1.0:
            dt -= (1 - 1 / self.acceptance) * self.profile.step_seconds(n, 0, context) * (1 + self.draft)
        self.last_step_s = dt
        return ModelOutput({s.seq.request_id: Sampled([self._next_token(s.seq)]) for s in batch if s.num_logits})


@dataclass
class _Request:
    rid: str
    arrival: float
    prompt: list[int]
    max_tokens: int
    key: str  # what affinity routing keeps together: a session or a shared prefix
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    follow: _Request | None = None  # the session's next turn: sent when this one ends, after its history


def make_requests(w: WorkloadShape, rate: float, count: int, vocab: int, seed: int = 0,
                  arrivals: Sequence[float] | None = None) -> list[_Request]:
    """``count`` requests at ``rate``/s with the workload's lengths and reusable prefixes, as bench sends them.

    Sessions (multi-turn, agentic) arrive at ``rate / turns`` and send each next turn when the last one
    ends, its prompt the whole history (earlier prompt and answer) plus the new user tokens, so a later
    turn hits the history only where the previous turn ran. The answer comes back as text, re-tokenized
    inside the chat template: the fleet's logs show the hit ending with the previous prompt, so the
    re-sent answer is new tokens here. ``arrivals``: the times at which sessions (or
    single requests) start, e.g. a bench run's own (:func:`fleetllm.bench.load.arrival_offsets`); default
    a Poisson sample of ``seed``."""
    rng = np.random.default_rng(seed)
    turns = w.turns
    sessions = math.ceil(count / turns)
    times = list(arrivals[:sessions]) if arrivals is not None else np.cumsum(rng.exponential(turns / rate, sessions))
    span = vocab - VOCAB_FLOOR
    shared = max(1, int(w.params.get("num_prefixes", 8)))
    popularity = 1.0 / np.arange(1, shared + 1) ** w.params.get("zipf", 1.0)  # bench's Zipf choice of a prefix
    popularity /= popularity.sum()
    out: list[_Request] = []
    for k, t in enumerate(times):
        prev = None
        for _ in range(min(turns, count - len(out))):
            i = len(out)
            isl, osl = int(w.isl[i % len(w.isl)]), max(1, int(w.osl[i % len(w.osl)]))
            if prev is not None:  # prev's prompt, then its answer as re-sent and the new user tokens
                new = max(1, isl - int(w.isl[(i - 1) % len(w.isl)]) - prev.max_tokens)
                req = _Request(f"r{i}", math.inf, _tokens(rng, span, prev.max_tokens + new), osl, f"s{k}")
                prev.follow = req
            elif w.shared_prefix:
                p = int(rng.choice(shared, p=popularity))
                head = (np.random.default_rng(10_000 + p).integers(0, span, int(isl * w.shared_prefix)) + VOCAB_FLOOR).tolist()
                req = _Request(f"r{i}", float(t), head + _tokens(rng, span, isl - len(head)), osl, f"p{p}")
            else:
                req = _Request(f"r{i}", float(t), _tokens(rng, span, isl), osl, f"s{k}" if turns > 1 else f"r{i}")
            out.append(req)
            prev = req
    return out


def _tokens(rng: np.random.Generator, span: int, n: int) -> list[int]:
    return (rng.integers(0, span, max(1, n)) + VOCAB_FLOOR).tolist()


class _Router:
    """The router's policies over the simulated replicas: round robin, least load, session affinity, and
    ``prefix``/``kv_aware`` as :class:`fleetllm.router.policies.PrefixAware` decides (bounded load, then the
    cost model's cheapest replica counting the prefix each one really holds). The cost model's rates are
    the ones a deployed router has: ``fleetllm serve`` starts it without ``--profile``, so the shipped
    profile's (:func:`fleetllm.cli.router_config`)."""

    def __init__(self, policy: str, engines: list[LLMEngine], seed: int = 0, balance: float = 1.25) -> None:
        self.policy, self.engines, self.turn, self.home = policy, engines, 0, {}
        self.cost, self.balance, self.rng = TimingProfile.default().cost_model(), balance, random.Random(seed)

    def pick(self, req: _Request) -> int:
        loads = [len(e.seqs) for e in self.engines]
        if self.policy == "round_robin":
            self.turn += 1
            return self.turn % len(self.engines)
        least = min(range(len(loads)), key=loads.__getitem__)
        if self.policy in ("kv_aware", "prefix"):
            return self._cheapest(req, loads)
        if self.policy == "session":
            home = self.home.setdefault(req.key, least)
            if loads[home] <= loads[least] + 4:  # spill a hot key only when its home is clearly busier
                return home
        return least

    def _cheapest(self, req: _Request, loads: list[int]) -> int:
        bound = math.ceil(self.balance * (sum(loads) + 1) / len(loads))
        eligible = [i for i, n in enumerate(loads) if n + 1 <= bound] or list(range(len(loads)))
        costs = []
        for i in eligible:
            sched = self.engines[i].scheduler
            cached = min(len(self.engines[i].kv.cached_prefix(req.prompt)[0]) * BLOCK, len(req.prompt) - 1)
            queued = sum(s.num_uncomputed for s in sched.waiting)
            queue = queued / self.cost.prefill_tokens_per_s + len(sched.waiting) / self.cost.decode_tokens_per_s
            # the router's decode term (CostModel.decode_s): its output (a simulated request runs to max_tokens,
            # what the router's moving average learns) beside the worker's sequences and their contexts
            streams = [*sched.running, *sched.waiting]
            context = sum(s.num_tokens for s in streams)
            decode = self.cost.gamma * req.max_tokens * self.cost.step_share_s(len(streams), context)
            costs.append((queue + (len(req.prompt) - cached) / self.cost.prefill_tokens_per_s + decode, i))
        low = min(c for c, _ in costs)
        return self.rng.choice([i for c, i in costs if c <= low + 1e-9])


def simulate(c: Candidate, step: StepModel, w: WorkloadShape, rate: float, kv_tokens: int,
             requests: int = 300, seed: int = 0, warmup: int | None = None,
             arrivals: Sequence[float] | None = None) -> Prediction:
    """The candidate's latencies with the real scheduler in virtual time.

    ``warmup``: requests left out of the statistics (default: the first tenth, which fills the caches); a
    short measured run is matched by simulating its own count and arrivals, cold caches included."""
    from fleetllm.models.source import load_tokenizer

    config, tokenizer = load_tokenizer("smollm2-135m")  # a stand-in: the simulation needs token ids, not text
    reqs = make_requests(w, rate, requests, config.vocab_size, seed, arrivals)
    longest = int(max(w.isl.max(), max(len(r.prompt) for r in reqs)) + w.osl.max()) + BLOCK
    config = _with_context(config, longest + BLOCK)
    al = c.spec.acceptance_length(w.category)
    blocks = min(MAX_BLOCKS, max(kv_tokens // BLOCK, longest // BLOCK + 8))
    model = SimulatedModel("sim", config, tokenizer)
    engines = [replica(c, step, model, blocks, longest + BLOCK, w.category, 10 * requests)
               for _ in range(c.replicas + c.prefill_replicas)]
    decode = engines[:c.replicas]
    _Fleet(decode, engines[c.replicas:], _Router(c.routing, decode, seed), c.pd_threshold,
           lambda tokens: kv_transfer_seconds(c, step, tokens), frame_import(step, BLOCK)).run(reqs)
    return _summary(reqs, step, al, requests // 10 if warmup is None else warmup)


def replica(c: Candidate, step: StepModel, model: SimulatedModel, blocks: int, max_len: int, category: str = "chat",
            max_waiting: int = 1000) -> LLMEngine:
    """One copy of candidate ``c``: the real engine with its limits over a :class:`VirtualExecutor` of ``step``."""
    ex = VirtualExecutor(model, step, blocks, c.spec, category)
    cfg = EngineConfig(model="sim", device="cpu", block_size=BLOCK, num_blocks=blocks, max_model_len=max_len,
                       max_num_seqs=c.max_batch, max_num_batched_tokens=max(c.chunk, c.max_batch),
                       max_waiting=max_waiting, disable_metrics=True)
    return LLMEngine(cfg, executor=ex)


def _with_context(config, tokens: int):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(config, max_position_embeddings=max(config.max_position_embeddings, tokens))


class _Fleet:
    """Decode replicas (routed by the policy) and an optional prefill pool, stepped in time order.

    P/D as the router does it (docs/architecture.md, "A request through a disaggregated fleet"): the decode replica is chosen first; a prompt whose tokens
    not cached there reach the threshold is prefilled on the least loaded prefill replica with fewer than
    the router's ``prefill_max_inflight`` prompts (none: the decode replica prefills it), its KV crosses
    the link and is imported (``frames``: the decode replica's verify and copy, which the request's first
    step waits for and the steps beside it lose on a CPU worker, :mod:`.kv_import`), and the decode replica
    then runs it, the frame's full blocks hits in its prefix cache (:func:`import_blocks`)."""

    def __init__(self, decode: list[LLMEngine], prefill: list[LLMEngine], router: _Router, threshold: int,
                 transfer_s: Callable[[int], float], frames: FrameImport = FrameImport()) -> None:
        self.engines, self.n_decode, self.router = decode + prefill, len(decode), router
        self.threshold, self.transfer_s, self.frames = threshold, transfer_s, frames
        self.imports = [ImportLoad() for _ in decode]
        self.clocks = [0.0] * len(self.engines)
        self.pending: list[tuple[float, int, _Request, int]] = []  # (time, order, request, engine or -1)
        self.order = 0
        self.target: dict[str, int] = {}  # a request in its prefill leg -> its decode replica
        self.by_id: dict[str, _Request] = {}

    def push(self, t: float, req: _Request, engine: int = -1) -> None:
        heapq.heappush(self.pending, (t, self.order, req, engine))
        self.order += 1

    def run(self, reqs: list[_Request]) -> None:
        self.by_id = {r.rid: r for r in reqs}
        for r in reqs:
            if math.isfinite(r.arrival):
                self.push(r.arrival, r)
        while self.pending or any(e.has_unfinished() for e in self.engines):
            busy = [i for i, e in enumerate(self.engines) if e.has_unfinished()]
            t_step = min((self.clocks[i] for i in busy), default=math.inf)
            if self.pending and self.pending[0][0] <= t_step:
                t, _, req, engine = heapq.heappop(self.pending)
                self._dispatch(t, req, engine)
            else:
                self._step(min(busy, key=self.clocks.__getitem__))

    def _dispatch(self, t: float, req: _Request, engine: int) -> None:
        tokens = req.max_tokens
        if engine < 0:
            engine = self.router.pick(req)
            hit = len(self.engines[engine].kv.cached_prefix(req.prompt)[0]) * BLOCK
            # as the router: a prefill replica with room, else the decode replica prefills it ("saturated")
            room = [k for k in range(self.n_decode, len(self.engines))
                    if len(self.engines[k].seqs) < RouterConfig.prefill_max_inflight]
            if room and len(req.prompt) - hit >= self.threshold:
                self.target[req.rid] = engine
                engine = min(room, key=lambda k: len(self.engines[k].seqs))
                tokens = 1  # the prefill leg computes the KV (and one token, not streamed)
        else:
            import_blocks(self.engines[engine], req.prompt)
        if not self.engines[engine].has_unfinished():
            self.clocks[engine] = max(self.clocks[engine], t)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        self.engines[engine].add_request(req.rid, req.prompt, params)

    def _step(self, i: int) -> None:
        ex = self.engines[i].executor
        ex.last_step_s = 0.0
        outs = self.engines[i].step()
        start, dt = self.clocks[i], ex.last_step_s or 1e-3  # a step that scheduled nothing still lets time pass
        self.clocks[i] += dt + (self.imports[i].stolen(start, start + dt) if i < self.n_decode else 0.0)
        for out in outs:
            r = self.by_id[out.request_id]
            if i >= self.n_decode:  # the prefill leg ended: the KV crosses to the decode replica
                if out.finished:
                    self._land(r, self.target.pop(r.rid), start, self.clocks[i])
                continue
            if out.new_token_ids and r.first is None:
                r.first = self.clocks[i]
            r.tokens += len(out.new_token_ids)
            if out.finished:
                r.done = self.clocks[i]
                if r.follow is not None:  # the session's next turn resends the history
                    nxt = r.follow
                    nxt.arrival, nxt.prompt = r.done, r.prompt + nxt.prompt
                    self.push(nxt.arrival, nxt)

    def _land(self, r: _Request, decode: int, step_start: float, step_end: float) -> None:
        """``r``'s KV, computed by a prefill step from ``step_start`` to ``step_end``, crosses the link and is
        imported by ``decode``, which then runs ``r`` (its import's CPU taken from the steps beside it)."""
        import_s = self.frames.seconds(len(r.prompt))
        link = self.transfer_s(len(r.prompt))
        start, end = import_window(import_s, self.frames.layers, step_start, step_end)
        self.imports[decode].add(start + link, end + link, self.frames.cost.steal * import_s)
        self.push(end + link, r, decode)


def import_blocks(engine: LLMEngine, prompt: list[int]) -> None:
    """Register ``prompt``'s full blocks in ``engine``'s prefix cache, as a real KV import leaves them (as many as
    fit above the scheduler's watermark): the request then hits them and computes the rest of its prompt, at
    least its last token, as the real decode worker does."""
    pool, hashes = engine.pool, hash_prefix_blocks(prompt, BLOCK, engine.kv.extra_key)
    held = engine.kv.cached_prefix(prompt)[0]
    for bid in held:  # pinned: the allocation below must not evict the head of the chain being imported
        pool.touch(bid)
    missing = hashes[len(held):][: max(0, pool.num_free - engine.scheduler.watermark_blocks)]
    new = pool.allocate(len(missing)) if missing else []
    for k, (bid, h) in enumerate(zip(new, missing, strict=True)):
        i = len(held) + k
        pool.register(bid, h, prompt[i * BLOCK:(i + 1) * BLOCK], hashes[i - 1] if i else None)
    pool.release(new + held)


def _summary(reqs: list[_Request], step: StepModel, al: float, warmup: int) -> Prediction:
    warm = reqs[warmup:]
    for r in warm:  # the serving path's time before the engine sees a request (calibrated; 0 by default)
        r.arrival -= step.request_overhead_s
    done = [r for r in warm if r.done is not None and r.first is not None]
    ttft = np.array([r.first - r.arrival for r in done])
    per_token = np.array([(r.done - r.first) / (r.tokens - 1) for r in done if r.tokens > 1])
    # ITL is bench's and the analytic model's: the gap between streamed chunks, one per verify step, which
    # carries AL tokens with speculation (the simulated request gets one token per 1/AL of a step)
    itl = per_token * al
    e2e = np.array([r.done - r.arrival for r in done])
    span = max(r.done for r in done) - min(r.arrival for r in done)
    tokens = sum(r.tokens for r in done)
    tpot = float(per_token.mean()) if len(per_token) else 0.0
    return Prediction(
        ttft_p50_ms=float(np.percentile(ttft, 50)) * 1e3, ttft_p90_ms=float(np.percentile(ttft, 90)) * 1e3,
        itl_p50_ms=float(np.percentile(itl, 50)) * 1e3 if len(itl) else 0.0,
        itl_p99_ms=float(np.percentile(itl, 99)) * 1e3 if len(itl) else 0.0,
        e2e_p90_s=float(np.percentile(e2e, 90)), output_tps=tokens / span, tps_per_user=1 / tpot if tpot else 0.0,
        utilization=0.0, rel_error=0.10 if step.measured else 0.22, measured=step.measured, queueing="simulated",
        extra={"acceptance_length": al, "requests": len(done)})
