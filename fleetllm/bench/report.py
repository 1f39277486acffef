"""Outputs of a benchmark: the result JSON, per-request JSONL, a wide CSV, console tables, compare.

The result JSON is the source of truth (``schema`` ``fleetllm.bench/v1``): ``config``,
``environment`` and ``runs`` (one per load point, each with ``load``, ``summary``, ``server_metrics``),
plus ``find_max_load`` when a search ran. Everything else is rendered from it.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import socket
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetllm.bench.client import RequestRecord
from fleetllm.bench.load import RunResult
from fleetllm.bench.metrics import PERCENTILES, chunk_gaps_ms, request_metrics

SCHEMA = "fleetllm.bench/v1"
STAT_COLUMNS = ("mean", "min", "max", "std", *(f"p{p}" for p in PERCENTILES))
TABLE_METRICS = ("ttft_ms", "ttst_ms", "itl_ms", "tpot_ms", "chunk_gap_ms", "e2e_ms", "output_tps_per_user",
                 "input_tokens", "output_tokens")
SCALARS = ("request_throughput", "input_token_throughput", "output_token_throughput", "goodput",
           "slo_attainment", "duration_s")


def environment() -> dict[str, Any]:
    """Where and when the client ran (the server describes itself through /metrics)."""
    from fleetllm import __version__

    return {
        "fleetllm_version": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "time_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }


def run_entry(result: RunResult, summary: dict[str, Any], server: dict[str, Any] | None) -> dict[str, Any]:
    """One load point as stored under ``runs``."""
    return {"label": result.load.label(), "load": asdict(result.load), "summary": summary, "server_metrics": server}


def build_result(config: dict[str, Any], runs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The whole result document."""
    return {"schema": SCHEMA, "config": config, "environment": environment(), "runs": runs, **extra}


def record_row(rec: RequestRecord, run_label: str, t0_ns: int) -> dict[str, Any]:
    """One JSONL line: identity, outcome, derived metrics and the raw chunk times (ms from send)."""
    return {
        "run": run_label,
        "request_id": rec.request_id,
        "session_id": rec.session_id,
        "turn": rec.turn,
        "warmup": rec.warmup,
        "error": rec.error,
        "error_detail": rec.error_detail,
        "cancelled": rec.cancelled,
        "finish_reason": rec.finish_reason,
        "max_tokens": rec.max_tokens,
        "scheduled_ms": (rec.scheduled_ns - t0_ns) / 1e6,
        "start_ms": (rec.start_ns - t0_ns) / 1e6,
        "end_ms": (rec.end_ns - t0_ns) / 1e6,
        "output_tokens_from_usage": rec.output_tokens_from_usage,
        "cached_tokens": rec.cached_tokens,
        "worker": rec.worker,
        **request_metrics(rec),
        "chunk_gaps_ms": chunk_gaps_ms(rec),
        "chunk_offsets_ms": [(c - rec.start_ns) / 1e6 for c in rec.chunk_ns],
    }


def write_outputs(result: dict[str, Any], run_results: list[RunResult], output: Path) -> list[Path]:
    """Write ``output`` (JSON), plus ``<stem>.requests.jsonl`` and ``<stem>.csv`` next to it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2, default=str))
    jsonl = output.with_suffix(".requests.jsonl")
    with open(jsonl, "w") as f:
        for rr in run_results:
            for rec in rr.warmup_records + rr.records:
                f.write(json.dumps(record_row(rec, rr.load.label(), rr.start_ns)) + "\n")
    csv_path = output.with_suffix(".csv")
    write_csv(result, csv_path)
    return [output, jsonl, csv_path]


def flat_summary(run: dict[str, Any]) -> dict[str, Any]:
    """A run as one flat row: scalars, request counts and ``<metric>_<stat>`` columns."""
    s = run["summary"]
    row: dict[str, Any] = {"label": run["label"]}
    row.update({f"requests_{k}": v for k, v in s["requests"].items()})
    row.update({k: s.get(k) for k in SCALARS})
    for metric, st in s["metrics"].items():
        row.update({f"{metric}_{c}": st.get(c) for c in STAT_COLUMNS})
    derived = (run.get("server_metrics") or {}).get("derived") or {}
    row.update({f"server_{k}": v for k, v in derived.items()})
    return row


def write_csv(result: dict[str, Any], path: Path) -> None:
    """One row per run (load point), wide columns, for spreadsheets and plotting elsewhere."""
    rows = [flat_summary(r) for r in result["runs"]]
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        # Narrow columns keep the 8-stat table readable in an 80-column terminal.
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_run(console: Console, run: dict[str, Any]) -> None:
    """The readable summary of one load point."""
    s = run["summary"]
    table = Table(title=f"fleetllm bench — {run['label']}", title_justify="left")
    # Every stat is in the JSON; a narrow terminal gets the ones people read first.
    cols = ("p50", "p90", "p95", "p99", "mean", "min", "max", "std") if console.width >= 100 else \
        ("p50", "p90", "p99", "mean", "max")
    table.add_column("metric", no_wrap=True)
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for m in TABLE_METRICS:
        st = s["metrics"].get(m) or {}
        if st.get("count"):
            table.add_row(m, *(_fmt(st.get(c)) for c in cols))
    console.print(table)
    req = s["requests"]
    console.print(
        f"requests {req['completed']}/{req['total']} ok, {req['errors']} errors"
        + (f" {s['errors_by_kind']}" if s["errors_by_kind"] else "")
        + f", {req['cancelled']} cancelled | {s['request_throughput']:.2f} req/s, "
        f"in {s['input_token_throughput']:.1f} tok/s, out {s['output_token_throughput']:.1f} tok/s"
        + (f" | goodput {s['goodput']:.2f} req/s, SLO attainment {s['slo_attainment']:.1%}" if "goodput" in s else "")
    )
    if "slo_checks" in s:
        checks = ", ".join(f"{k}={_fmt(v['value'])}≤{v['limit']:g} {'✓' if v['passed'] else '✗'}"
                           for k, v in s["slo_checks"].items())
        console.print(f"SLOs: {checks} → {'met' if s['slo_met'] else 'NOT met'}")
    derived = (run.get("server_metrics") or {}).get("derived") or {}
    if any(v is not None for v in derived.values()):
        console.print("server: " + ", ".join(f"{k}={_fmt(v)}" for k, v in derived.items() if v is not None))


COMPARE_KEYS = ("request_throughput", "output_token_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "requests_errors",
                "goodput", "slo_attainment")


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of (run, key, a, b, b/a) for runs matched by position."""
    rows = []
    for ra, rb in zip(a["runs"], b["runs"], strict=False):
        fa, fb = flat_summary(ra), flat_summary(rb)
        for k in COMPARE_KEYS:
            va, vb = fa.get(k), fb.get(k)
            if va is None and vb is None:
                continue
            ratio = vb / va if isinstance(va, int | float) and isinstance(vb, int | float) and va else None
            rows.append({"run": f"{ra['label']} | {rb['label']}", "key": k, "a": va, "b": vb, "ratio": ratio})
    return rows


def print_compare(console: Console, rows: list[dict[str, Any]], name_a: str, name_b: str) -> None:
    """Side-by-side table with b/a ratios."""
    table = Table(title=f"compare: b={name_b} vs a={name_a}", title_justify="left")
    for c in ("run", "metric", "a", "b", "b/a"):
        table.add_column(c, justify="left" if c in ("run", "metric") else "right")
    for r in rows:
        table.add_row(r["run"], r["key"], _fmt(r["a"]), _fmt(r["b"]), f"{r['ratio']:.3f}x" if r["ratio"] else "-")
    console.print(table)
