"""``fleetllm recommend --validate``: deploy the best local candidates here, measure them with ``fleetllm
bench``, and set the measurement beside the prediction.

Each candidate's fleet YAML is started with ``fleetllm serve`` (real workers, or simulated ones running
the calibrated profile with ``--validate-simulated``), loaded by the bench at the recommended rate with
the same workload, then stopped. The measured/predicted ratios are written to ``calibration.json``:
the correction a later run can apply (``docs/recommend.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from fleetllm.recommend.calibration import Calibration, fit
from fleetllm.recommend.candidate import Candidate
from fleetllm.recommend.config import RecommendConfig
from fleetllm.recommend.fleet_yaml import fleet_yaml
from fleetllm.recommend.model_shape import ModelShape
from fleetllm.recommend.search import Scored
from fleetllm.recommend.workload import WorkloadShape

METRICS = {"ttft_p50_ms": ("ttft_ms", "p50", 1.0), "ttft_p90_ms": ("ttft_ms", "p90", 1.0),
           "itl_p50_ms": ("itl_ms", "p50", 1.0), "itl_p99_ms": ("itl_ms", "p99", 1.0), "e2e_p90_s": ("e2e_ms", "p90", 1e-3)}


def free_port(span: int = 1) -> int:
    """A port with ``span`` free ones from it (the router, then its workers)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65000 and all(_free(port + i) for i in range(1, span + 1)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Fleet:
    """``fleetllm serve --config`` in a child process, until :meth:`stop`."""

    def __init__(self, yaml_path: Path, port: int, log: Path, timeout_s: float = 300.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "fleetllm.cli", "serve", "--config", str(yaml_path),
                                          "--log-dir", str(log.parent / f"{log.stem}-logs")],
                                         stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        end = time.monotonic() + timeout_s
        while "fleet ready" not in log.read_text() or not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()  # never leave a half-started fleet behind
                raise RuntimeError(f"fleet did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bench_argv(w: WorkloadShape, url: str, model: str, rate: float, requests: int, slo: dict[str, float],
               output: Path, seed: int) -> list[str]:
    """The ``fleetllm bench`` flags that send workload ``w`` at ``rate`` requests/s (bench's rate is of sessions:
    ``rate / turns`` of them for a multi-turn or agentic workload)."""
    p = w.params
    if w.name in ("synthetic", "shared-prefix", "multi-turn", "agentic", "long-short"):
        kind = w.name
    elif w.name.startswith("isl="):
        kind = "synthetic"
    else:
        kind = "trace"
    argv = ["--url", url, "--model", model, "--workload", kind, "--request-rate", f"{rate / w.turns:.6g}",
            "--requests", str(requests), "--warmup-requests", "2", "--seed", str(seed), "--no-progress",
            "--output", str(output)]
    for key in ("isl", "osl", "isl_std", "osl_std", "prefix_len", "turns", "system_len", "context_len", "step_len",
                "long_isl", "long_osl", "long_fraction"):
        if key in p:
            argv += ["--" + key.replace("_", "-"), f"{p[key]:g}"]
    if kind == "trace":
        argv += ["--trace", w.name]
    slos = [f"{k.replace('e2e_p90_s', 'e2e_p90_ms')}={v * (1e3 if k == 'e2e_p90_s' else 1):g}" for k, v in slo.items()]
    return argv + ["--slo", ",".join(slos)] if slos else argv


def start_fleet(c: Candidate, shape: ModelShape, simulate: bool, out: Path, i: int, tries: int = 3) -> Fleet:
    """Candidate ``c``'s fleet on free ports; another port on failure (another process may take one first)."""
    for attempt in range(tries):
        port = free_port(c.replicas + c.prefill_replicas + 1)
        path = out / f"validate-{i}.yaml"
        path.write_text(fleet_yaml(c, shape, simulate=simulate, port=port))
        try:
            return Fleet(path, port, out / f"validate-{i}.log")
        except RuntimeError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def measure(c: Candidate, shape: ModelShape, w: WorkloadShape, rate: float, cfg: RecommendConfig, out: Path,
            i: int, slo: dict[str, float]) -> dict[str, Any]:
    """Start candidate ``c``'s fleet, bench it at ``rate``, stop it; the bench's summary, reduced."""
    from fleetllm.bench.cli import add_bench_arguments, run_bench

    fleet = start_fleet(c, shape, cfg.validate_simulated, out, i)
    try:
        parser = argparse.ArgumentParser()
        add_bench_arguments(parser)
        args = parser.parse_args(bench_argv(w, fleet.url, shape.name, rate, cfg.validate_requests, slo,
                                            out / f"validate-{i}.bench.json", cfg.seed))
        result = run_bench(args, Console(quiet=True))
    finally:
        fleet.stop()
    summary = result["runs"][0]["summary"]
    got = {k: (summary["metrics"][m][stat] or 0.0) * scale for k, (m, stat, scale) in METRICS.items()}
    got["output_tps"] = summary["output_token_throughput"]
    got["errors"] = summary["requests"]["errors"]
    return got


def validate(ranked: list[Scored], shape: ModelShape, w: WorkloadShape, rate: float, cfg: RecommendConfig,
             out: Path, console: Console) -> list[dict[str, Any]]:
    """Predicted against measured for the best ``cfg.validate_top`` local candidates."""
    local = [s for s in ranked if s.candidate.instance.local and s.meets_slos][:cfg.validate_top]
    if not local:
        console.print("--validate: no local candidate meets the SLOs; nothing to deploy here")
        return []
    from fleetllm.recommend.recommend import parse_slo

    rows = []
    for i, s in enumerate(local):
        got = measure(s.candidate, shape, w, rate, cfg, out, i, parse_slo(cfg.slo))
        predicted = {k: getattr(s.prediction, k) for k in METRICS} | {"output_tps": s.prediction.output_tps}
        errors = {k: (predicted[k] - got[k]) / got[k] for k in predicted if got.get(k)}
        rows.append({"label": s.candidate.label(), "workers": "simulated" if cfg.validate_simulated else "real",
                     "predicted": predicted, "measured": got, "relative_error": errors})
        console.print(f"validate {s.candidate.label()}: " + ", ".join(
            f"{k} {predicted[k]:.3g} vs {got[k]:.3g} ({errors.get(k, 0):+.0%})" for k in predicted))
    (out / "calibration.json").write_text(json.dumps({**fit(rows, Calibration.load(cfg.calibration)), "rows": rows}, indent=2) + "\n")
    return rows
