"""P/D at scale, on paper: ``benchmarks/disaggregation.py --fleet sim``.

The fleet model of :mod:`fleetllm.sim.pd_fleet` (the engine's step timed by the measured SmolLM2-on-CPU
profile, one core per worker, a prefill pool when split, the KV at a measured bandwidth) for fleets of
8-64 workers and long-document shares of 5-50%. Every split of the same workers (colocated, or 1/8 .. 1/2
of them prefilling) and every threshold (a token count, or ``auto``: the router's own decision) gets the
same offered traffic: what keeps a colocated worker ``--sim-load`` busy. A split *pays* when the short
requests' ITL p99 is lower than colocated, both kinds' TTFT p90 at most 1.5x colocated's, and no queue
(decode worker or prefill pool) keeps growing.
Seconds to run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetllm.sim.pd_fleet import PdTraffic, rate_for_load, simulate_pd
from fleetllm.sim.profile import TimingProfile

WORKERS = (8, 16, 32, 64)
LONG_SHARES = (0.05, 0.1, 0.25, 0.5)
PREFILL_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2)
THRESHOLDS: tuple[int | str, ...] = (512, 1024, 2048, "auto")
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x KV heads x head dim x fp32


def cell(profile: TimingProfile, n: int, share: float, load: float, gbs: float) -> dict[str, Any]:
    """One fleet size and long-document share: colocated and every split, on the same traffic."""
    base = PdTraffic(0.0, share)
    traffic = PdTraffic(rate_for_load(profile, base, load), share)

    def run(prefill: int, threshold: int | str) -> dict[str, Any]:
        r = simulate_pd(profile, traffic, n, prefill, threshold, KV_BYTES_PER_TOKEN, gbs * 1e9)
        return {"prefill": prefill, "decode": n - prefill, "threshold": threshold if prefill else None, **vars(r)}

    co = run(0, 0)
    splits = [run(max(1, round(n * f)), t) for f in PREFILL_FRACTIONS for t in THRESHOLDS]
    paying = [s for s in splits if not s["saturated"] and s["short_itl_p99_ms"] < co["short_itl_p99_ms"]
              and s["short_ttft_p90_ms"] <= 1.5 * co["short_ttft_p90_ms"]
              and s["long_ttft_p90_ms"] <= 1.5 * co["long_ttft_p90_ms"]]
    best = min(paying, key=lambda s: s["short_itl_p99_ms"]) if paying else None
    return {"workers": n, "long_share": share, "rate_per_worker": traffic.rate_per_worker, "colocated": co,
            "best": best, "splits": splits}


def bandwidth_gbs(out_dir: Path) -> float:
    """The shared-memory transfer rate of the last ``--transfer`` run in ``out_dir``, else 1 GB/s."""
    try:
        return float(json.loads((out_dir / "disaggregation.json").read_text())["transfer"]["shm_GBps"])
    except (OSError, KeyError, ValueError):
        return 1.0


def run_sim(console: Console, out_dir: Path, load: float = 0.6, gbs: float | None = None) -> int:
    t0 = time.perf_counter()
    gbs = gbs or bandwidth_gbs(out_dir)
    profile = TimingProfile.default()
    cells = [cell(profile, n, s, load, gbs) for n in WORKERS for s in LONG_SHARES]
    t = Table(title=f"P/D on paper: SmolLM2-135M on 1 core per worker ({profile.machine or 'shipped profile'}), KV "
                    f"at {gbs:.2f} GB/s, traffic keeping a colocated worker {load:.0%} busy")
    for col in ("workers", "long share", "colocated ITL p99 / short TTFT p90 ms", "what pays: prefill:decode @ threshold",
                "its ITL p99 / short TTFT p90 ms", "ITL p99 gain", "long TTFT p90 s (colocated -> split)"):
        t.add_column(col)
    for c in cells:
        co, b = c["colocated"], c["best"]
        sat = " (saturated)" if co["saturated"] else ""
        t.add_row(str(c["workers"]), f"{c['long_share']:.0%}",
                  f"{co['short_itl_p99_ms']:.0f} / {co['short_ttft_p90_ms']:.0f}{sat}",
                  f"{b['prefill']}:{b['decode']} @ {b['threshold']}" if b else "nothing: stay colocated",
                  f"{b['short_itl_p99_ms']:.0f} / {b['short_ttft_p90_ms']:.0f}" if b else "-",
                  f"{co['short_itl_p99_ms'] / b['short_itl_p99_ms']:.2f}x" if b else "-",
                  f"{co['long_ttft_p90_ms'] / 1e3:.1f} -> {b['long_ttft_p90_ms'] / 1e3:.1f}" if b else "-")
    console.print(t)
    seconds = time.perf_counter() - t0
    console.print(f"{len(cells)} cells, {sum(len(c['splits']) + 1 for c in cells)} fleets simulated in {seconds:.1f} s")
    (out_dir / "disaggregation_sim.json").write_text(json.dumps(
        {"bandwidth_GBps": gbs, "load": load, "cells": cells, "seconds": seconds}, indent=2))
    console.print(f"wrote {out_dir / 'disaggregation_sim.json'}")
    return 0
