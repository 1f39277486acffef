"""The search: every instance × tensor parallel × format × batch × chunk × speculation × routing × P/D ×
replicas, pruned before anything is predicted.

Pruning, in order, each counted: a format beyond the quality limit or that the hardware cannot run;
weights that do not fit the replica's memory, or a KV cache smaller than one request; replica counts
whose roofline upper bound on throughput (full batches, no prefill, no queueing) is below the traffic;
a P/D split when no request's uncached prompt reaches its threshold. What survives is predicted
analytically (:mod:`fleetllm.recommend.queueing`); only the smallest few replica counts that meet the
SLOs are kept per configuration, since more copies of the same thing only cost more.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from fleetllm.recommend.calibration import Calibration
from fleetllm.recommend.candidate import Candidate, Prediction
from fleetllm.recommend.catalogue import Catalogue, Format, Instance
from fleetllm.recommend.model_shape import ModelShape, profiled_shape
from fleetllm.recommend.perf_model import Efficiency, Measured, Roofline, StepModel
from fleetllm.recommend.queueing import capacity, meets, predict
from fleetllm.recommend.speculation import CHOICES, Speculation
from fleetllm.recommend.workload import WorkloadShape
from fleetllm.sim.profile import TimingProfile

OBJECTIVES = ("cost", "throughput", "latency")
ROUTINGS = ("round_robin", "least_load", "kv_aware")
FLOOR_UTILIZATION = 0.3


@dataclass(frozen=True)
class SearchSpace:
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    batches: tuple[int, ...] = (16, 64, 256)
    chunks: tuple[int, ...] = (512, 2048, 8192)
    cpu_batches: tuple[int, ...] = (4, 8, 16, 32)
    cpu_chunks: tuple[int, ...] = (128, 256, 512)
    specs: tuple[Speculation, ...] = tuple(CHOICES)
    routings: tuple[str, ...] = ROUTINGS
    pd: tuple[tuple[float, int], ...] = ((0.0, 0), (0.25, 1024), (0.5, 1024), (0.25, 4096))  # (prefill share, threshold)
    max_replicas: int = 16
    keep_per_config: int = 1  # replica counts kept per configuration once the SLOs are met


@dataclass
class Scored:
    candidate: Candidate
    prediction: Prediction
    meets_slos: bool


@dataclass
class SearchResult:
    scored: list[Scored]  # every predicted candidate, ranked by the objective (meeting SLOs first)
    considered: int  # candidates enumerated, pruned ones included
    predicted: int
    pruned: dict[str, int]
    seconds: float
    steps: dict[tuple[str, int, str], StepModel] = field(default_factory=dict)


def step_model(shape: ModelShape, inst: Instance, fmt: Format, tp: int, eff: Efficiency,
               calibration: Calibration = Calibration()) -> StepModel:
    """The measured profile (and the validation's calibration) on a machine that has one, the roofline elsewhere."""
    if inst.profile:
        profile = TimingProfile.load(inst.profile)
        return Measured(profile, shape, fmt, profiled_shape(profile.model), calibration, inst.memory_gb)
    return Roofline(shape, inst, fmt, tp, eff)


def formats_for(inst: Instance, cat: Catalogue, max_loss: float, pruned: dict[str, int]) -> list[Format]:
    out = []
    for f in cat.formats.values():
        cpu_format = f.compute == "fp32"
        if cpu_format != inst.is_cpu or f.quality_loss_pct > max_loss:
            pruned["format (quality or hardware)"] += 1
        elif f.compute == "fp4" and not inst.runs_natively("fp4"):
            pruned["format (quality or hardware)"] += 1
        else:
            out.append(f)
    return out


def _fits(step: StepModel, shape: ModelShape, w: WorkloadShape) -> int:
    """KV tokens the replica holds, or 0 when the weights or one longest request do not fit."""
    kv = step.kv_capacity_tokens()
    longest = w.isl.max() + w.osl.max()
    return kv if kv >= longest and longest <= shape.max_context + w.osl.max() else 0


def _upper_rate(c: Candidate, step: StepModel, w: WorkloadShape, kv: int) -> float:
    """Requests/s one replica could at most finish: full batches, decode only, no queueing."""
    batch = max(1, int(min(c.max_batch, kv / (w.isl_mean + w.osl_mean))))
    width = c.spec.verify_width(w.category)
    per_step = step.step_seconds(batch * width, 0, int(batch * w.isl_mean))
    return batch * c.spec.acceptance_length(w.category) / per_step / w.osl_mean


def search(shape: ModelShape, w: WorkloadShape, rate: float, slos: dict[str, float], cat: Catalogue,
           space: SearchSpace = SearchSpace(), max_quality_loss: float = 1.0, eff: Efficiency = Efficiency(),
           instances: list[str] | None = None, calibration: Calibration = Calibration()) -> SearchResult:
    """Every candidate for serving ``shape`` at ``rate`` requests/s of ``w``, predicted and ranked by cost."""
    t0 = time.perf_counter()
    pruned = {"format (quality or hardware)": 0, "memory fit": 0, "roofline bound": 0, "P/D has no long prompts": 0,
              "more replicas than needed": 0, "latency floor": 0,
              "routing (one replica)": 0}
    scored: list[Scored] = []
    steps: dict[tuple[str, int, str], StepModel] = {}
    considered = 0
    per_config = len(space.specs) * len(space.routings) * len(space.pd) * space.max_replicas
    for inst in cat.instances:
        if instances and inst.name not in instances:
            continue
        for fmt in formats_for(inst, cat, max_quality_loss, pruned):
            for tp in (1,) if inst.is_cpu else [t for t in space.tensor_parallel if t <= inst.count]:
                if tp > 1 and not inst.interconnect_gbs:
                    continue
                step = step_model(shape, inst, fmt, tp, eff, calibration)
                batches, chunks = (space.cpu_batches, space.cpu_chunks) if inst.is_cpu else (space.batches, space.chunks)
                n = len(batches) * len(chunks) * per_config
                considered += n
                kv = _fits(step, shape, w)
                if not kv:
                    pruned["memory fit"] += n
                    continue
                steps[inst.name, tp, fmt.name] = step
                for batch in batches:
                    for chunk in chunks:
                        scored += _configs(inst, tp, fmt, batch, chunk, step, kv, w, rate, slos, space, pruned)
    return SearchResult(scored, considered, len(scored), pruned, time.perf_counter() - t0, steps)


def _configs(inst: Instance, tp: int, fmt: Format, batch: int, chunk: int, step: StepModel, kv: int,
             w: WorkloadShape, rate: float, slos: dict[str, float], space: SearchSpace,
             pruned: dict[str, int]) -> list[Scored]:
    out: list[Scored] = []
    for spec in space.specs:
        base = Candidate(inst, tp, fmt, 1, batch, chunk, spec)
        upper = _upper_rate(base, step, w, kv)
        first = max(1, math.ceil(rate / upper))
        for routing in space.routings:
            for share, threshold in space.pd:
                if share and not w.fraction_at_least(threshold, 0.0):
                    pruned["P/D has no long prompts"] += space.max_replicas
                    continue
                pruned["roofline bound"] += min(first - 1, space.max_replicas)
                kept = 0
                for total in range(first, space.max_replicas + 1):
                    if total == 1 and routing != space.routings[0]:
                        pruned["routing (one replica)"] += 1
                        continue
                    if kept >= space.keep_per_config:
                        pruned["more replicas than needed"] += 1
                        continue
                    prefill = round(total * share)
                    if share and (prefill == 0 or prefill == total):
                        continue
                    cand = Candidate(inst, tp, fmt, total - prefill, batch, chunk, spec, routing, prefill, threshold)
                    p = predict(cand, step, w, rate, kv)
                    ok = meets(p, slos)
                    kept += ok
                    out.append(Scored(cand, p, ok))
                    if not ok and p.utilization < FLOOR_UTILIZATION:  # a latency floor: more copies won't help
                        pruned["latency floor"] += space.max_replicas - total
                        break
    return out


def rank(result: SearchResult, objective: str, w: WorkloadShape, rate: float, slos: dict[str, float],
         headroom_for: int = 20) -> list[Scored]:
    """Candidates meeting the SLOs first, then by the objective; the first ``headroom_for`` get their capacity."""
    def key(s: Scored) -> tuple[float, ...]:
        c, p = s.candidate, s.prediction
        if objective == "latency":
            return (not s.meets_slos, p.e2e_p90_s, p.ttft_p90_ms, c.price_per_hour)
        if objective == "throughput":
            return (not s.meets_slos, -p.output_tps / c.gpus, c.price_per_hour)
        return (not s.meets_slos, c.price_per_hour, p.e2e_p90_s)

    ranked = sorted(result.scored, key=key)
    for s in ranked[:headroom_for]:
        if s.meets_slos:
            step = result.steps[s.candidate.instance.name, s.candidate.tp, s.candidate.fmt.name]
            kv = step.kv_capacity_tokens()
            s.prediction.capacity_rps = capacity(s.candidate, step, w, kv, slos, rate)
    if objective == "throughput":  # tokens/s per GPU at the most traffic each one takes within the SLOs
        top = [s for s in ranked[:headroom_for] if s.prediction.capacity_rps]
        top.sort(key=lambda s: -(s.prediction.capacity_rps or 0) * w.osl_mean / s.candidate.gpus)
        ranked = top + [s for s in ranked if s not in top]
    return ranked
