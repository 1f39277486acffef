"""One end-to-end run of ``fleetllm bench`` against the real worker (smollm2-135m on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fleetllm.server.app")

from fleetllm.cli import main as fleetllm_main  # noqa: E402


@pytest.mark.slow
def test_bench_against_the_real_worker(worker, tmp_path: Path):
    out = tmp_path / "real.json"
    args = ["bench", "--url", worker.base_url, "--model", "smollm2-135m", "--concurrency", "2", "--requests", "4",
            "--isl", "32", "--osl", "8", "--workload", "shared-prefix", "--num-prefixes", "1", "--prefix-len", "64",
            "--output", str(out), "--no-progress", "--slo", "ttft_p99_ms=600000"]
    assert fleetllm_main(args) == 0
    result = json.loads(out.read_text())
    assert result["config"]["token_calibration"]["source"] == "server /tokenize"
    (run,) = result["runs"]
    s = run["summary"]
    assert s["requests"] == {"total": 4, "completed": 4, "errors": 0, "cancelled": 0}
    assert s["metrics"]["output_tokens"]["mean"] == 8  # ignore_eos honoured, usage reported
    assert s["metrics"]["input_tokens"]["min"] >= 64 + 32
    assert s["metrics"]["tpot_ms"]["count"] == 4
    server = run["server_metrics"]
    assert server is not None and server["derived"]["prefix_cache_hit_rate"] > 0  # one shared system prompt
