"""What ``fleetllm recommend`` shows and writes: the ranked table, the Pareto front, the JSON document."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetllm.recommend.candidate import LATENCY_KEYS, Candidate, Prediction
from fleetllm.recommend.search import Scored, SearchResult


def dollars_per_million(c: Candidate, p: Prediction) -> float:
    """$ per 1M output tokens at the predicted throughput."""
    return c.price_per_hour / (p.output_tps * 3600 / 1e6) if p.output_tps else math.inf


def headroom(p: Prediction, rate: float) -> float | None:
    """How much more traffic it takes within the SLOs (0.5: +50%)."""
    return p.capacity_rps / rate - 1 if p.capacity_rps is not None and rate else None


def source(p: Prediction) -> str:
    return f"{'measured' if p.measured else 'modelled'} steps, {p.queueing} queueing, ±{p.rel_error:.0%}"


def entry(s: Scored, rate: float) -> dict[str, Any]:
    """One ranked candidate for ``--json``."""
    c, p = s.candidate, s.prediction
    return {
        "label": c.label(), "meets_slos": s.meets_slos, "instance": c.instance.name, "instances": c.instances,
        "tensor_parallel": c.tp, "replicas": c.replicas, "prefill_replicas": c.prefill_replicas,
        "pd_threshold": c.pd_threshold if c.prefill_replicas else None, "format": c.fmt.name, "max_batch": c.max_batch,
        "chunk": c.chunk, "speculation": str(c.spec), "routing": c.routing, "gpus": c.gpus,
        "price_per_hour": c.price_per_hour, "price_date": c.instance.price_date,
        "dollars_per_million_output_tokens": dollars_per_million(c, p),
        "tokens_per_s_per_user": p.tps_per_user, "tokens_per_s_per_gpu": p.output_tps / c.gpus,
        "output_tokens_per_s": p.output_tps, "headroom": headroom(p, rate), "capacity_rps": p.capacity_rps,
        "predicted": {k: getattr(p, k) for k in LATENCY_KEYS},
        "interval": {k: list(p.interval(k)) for k in LATENCY_KEYS},
        "measured_steps": p.measured, "queueing": p.queueing, "relative_error": p.rel_error,
        "extra": p.extra,
    }


def print_table(console: Console, ranked: list[Scored], rate: float, top: int) -> None:
    t = Table(title=f"fleetllm recommend: top {top} at {rate:.3g} req/s")
    for col in ("#", "deployment", "SLOs", "$/h", "$/1M out", "tok/s/user", "tok/s/GPU", "TTFT p90 ms", "ITL p99 ms",
                "E2E p90 s", "headroom", "source"):
        t.add_column(col, overflow="fold")
    for i, s in enumerate(ranked[:top], 1):
        c, p = s.candidate, s.prediction
        h = headroom(p, rate)
        t.add_row(str(i), c.label(), "yes" if s.meets_slos else "no", f"{c.price_per_hour:.2f}",
                  f"{dollars_per_million(c, p):.2f}", f"{p.tps_per_user:.1f}", f"{p.output_tps / c.gpus:.1f}",
                  _pm(p, "ttft_p90_ms", 0), _pm(p, "itl_p99_ms", 1), _pm(p, "e2e_p90_s", 2),
                  "-" if h is None else f"{h:+.0%}", source(p))
    console.print(t)


def _pm(p: Prediction, key: str, digits: int) -> str:
    v = getattr(p, key)
    return f"{v:.{digits}f} ±{v * p.rel_error:.{digits}f}" if math.isfinite(v) else "inf"


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (higher is better)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def write_pareto_png(result: SearchResult, path: Path) -> list[dict[str, float]]:
    """tokens/s/GPU against tokens/s/user of every feasible candidate, the front drawn; returns the front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in result.scored if s.prediction.feasible]
    pts = [(s.prediction.tps_per_user, s.prediction.output_tps / s.candidate.gpus) for s in ok]
    front = pareto(pts)
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([x for x, _ in pts], [y for _, y in pts], s=4, alpha=0.3, label="candidates")
    fx = sorted((pts[i] for i in front), key=lambda p: p[0])
    ax.plot([x for x, _ in fx], [y for _, y in fx], "r.-", label="Pareto front")
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU (or core)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [{"tokens_per_s_per_user": pts[i][0], "tokens_per_s_per_gpu": pts[i][1], "label": ok[i].candidate.label()}
            for i in front]
