"""Plots (PNG) and a single-file HTML report with the PNGs inlined.

matplotlib is imported lazily with the Agg backend, so the bench runs (and tests) without a display
and without paying for matplotlib when no plot is asked for.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import numpy as np

from fleetllm.bench.load import RunResult
from fleetllm.bench.metrics import request_metrics
from fleetllm.bench.report import flat_summary


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(results: list[RunResult], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2E, one line per load point."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), strict=True):
        for rr in results:
            vals = np.sort([v for r in rr.records if r.ok and (v := request_metrics(r)[metric]) is not None])
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=rr.load.label())
        ax.set_xlabel(metric)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def throughput_vs_load(result: dict[str, Any], path: Path) -> Path:
    """Output tok/s (total) and per-user tok/s (p50) against the swept load."""
    plt = _plt()
    runs = result["runs"]
    rate = runs[0]["load"]["request_rate"] is not None
    xs = [r["load"]["request_rate"] if rate else r["load"]["concurrency"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["summary"]["output_token_throughput"] for r in runs], "o-", label="output tok/s (total)")
    ax.set_xlabel("request rate (req/s)" if rate else "concurrency")
    ax.set_ylabel("output tok/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [flat_summary(r).get("output_tps_per_user_p50") for r in runs], "s--", color="tab:orange",
             label="per-user tok/s (p50)")
    ax2.set_ylabel("per-user tok/s")
    fig.legend(loc="lower center", ncol=2, fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def ttft_over_time(results: list[RunResult], path: Path) -> Path:
    """TTFT of each request against when it was sent (s since its run started)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for rr in results:
        pts = [((r.start_ns - rr.start_ns) / 1e9, request_metrics(r)["ttft_ms"]) for r in rr.records if r.ok]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=8, label=rr.load.label())
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], results: list[RunResult], stem: Path) -> list[Path]:
    """All PNGs for a result, named ``<stem>.<plot>.png``."""
    out = [latency_cdfs(results, stem.with_suffix(".latency_cdf.png")),
           ttft_over_time(results, stem.with_suffix(".ttft_over_time.png"))]
    if len(result["runs"]) > 1:
        out.append(throughput_vs_load(result, stem.with_suffix(".throughput.png")))
    return out


def write_html(result: dict[str, Any], pngs: list[Path], path: Path) -> Path:
    """One self-contained HTML file: summary table per run, then the plots inlined as data URIs."""
    rows = [flat_summary(r) for r in result["runs"]]
    keys = ["label", "requests_completed", "requests_errors", "request_throughput", "output_token_throughput",
            "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "e2e_ms_p99", "goodput",
            "slo_attainment", "server_prefix_cache_hit_rate"]

    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else html.escape(str(v if v is not None else "-"))

    table = "<tr>" + "".join(f"<th>{html.escape(k)}</th>" for k in keys) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{cell(r.get(k))}</td>" for k in keys) + "</tr>" for r in rows)
    imgs = "".join(
        f'<h3>{html.escape(p.name)}</h3><img src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for p in pngs)
    cfg = html.escape(str(result.get("config", {})))
    search = result.get("find_max_load")
    search_html = f"<h2>SLO search</h2><pre>{html.escape(str(search))}</pre>" if search else ""
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>fleetllm bench</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:4px 8px;text-align:right}img{max-width:100%}</style></head><body><h1>fleetllm bench</h1>"
        f"<p>{html.escape(result['environment']['time_utc'])}</p><table>{table}</table>{search_html}{imgs}"
        f"<h2>config</h2><pre>{cfg}</pre></body></html>")
    return path
