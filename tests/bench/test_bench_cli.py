"""The bench command end to end against the fake server: outputs, sweeps, compare, SLO search."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from rich.console import Console

from fleetllm.bench.cli import main, run_compare
from fleetllm.bench.client import ClientConfig
from fleetllm.bench.load import LoadConfig
from fleetllm.bench.search import Measurer, find_max_load
from fleetllm.bench.workloads import MultiTurnWorkload, PromptBuilder

BASE = ["--model", "fake", "--isl", "8", "--osl", "4", "--no-progress"]


def run_cli(fake, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "run.json"
    assert main(["--url", fake.url, *BASE, "--output", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_single_run_writes_json_jsonl_and_csv(fake, tmp_path: Path):
    result = run_cli(fake, tmp_path, "--concurrency", "2", "--requests", "6", "--warmup-requests", "2")
    assert result["schema"] == "fleetllm.bench/v1"
    assert {"config", "environment", "runs"} <= set(result)
    assert result["config"]["token_calibration"]["source"] == "server /tokenize"
    (run,) = result["runs"]
    assert run["label"] == "c=2" and run["summary"]["requests"]["total"] == 6
    assert run["server_metrics"]["gauges"]["vllm:kv_cache_usage_perc"]["after"] == 0.25
    lines = [json.loads(x) for x in (tmp_path / "run.requests.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and sum(x["warmup"] for x in lines) == 2
    assert all(len(x["chunk_gaps_ms"]) == 3 for x in lines)
    rows = list(csv.DictReader(open(tmp_path / "run.csv")))
    assert len(rows) == 1 and float(rows[0]["ttft_ms_p99"]) > 0


def test_main_fleetllm_cli_dispatches_bench(fake, tmp_path: Path):
    from fleetllm.cli import main as fleetllm_main

    out = tmp_path / "via_main.json"
    assert fleetllm_main(["bench", "--url", fake.url, *BASE, "--requests", "2", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["runs"][0]["summary"]["requests"]["completed"] == 2


@pytest.mark.slow
def test_concurrency_sweep_plots_and_html(fake, tmp_path: Path):
    result = run_cli(fake, tmp_path, "--concurrency", "1,2", "--requests", "4", "--plots")
    assert [r["label"] for r in result["runs"]] == ["c=1", "c=2"]
    for name in ("run.latency_cdf.png", "run.ttft_over_time.png", "run.throughput.png", "run.html"):
        assert (tmp_path / name).stat().st_size > 1000
    html = (tmp_path / "run.html").read_text()
    assert "data:image/png;base64," in html and "<script" not in html


def test_rate_sweep_with_goodput_slo(fake, tmp_path: Path):
    result = run_cli(fake, tmp_path, "--request-rate", "100,200", "--arrival", "gamma", "--burstiness", "0.5",
                     "--requests", "5", "--slo", "ttft_ms=60000")
    assert [r["label"] for r in result["runs"]] == ["rate=100", "rate=200"]
    assert all(r["summary"]["slo_attainment"] == 1.0 for r in result["runs"])


def test_compare_prints_ratios(fake, tmp_path: Path):
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir()
    b.mkdir()
    run_cli(fake, a, "--concurrency", "1", "--requests", "3")
    run_cli(fake, b, "--concurrency", "1", "--requests", "3")
    assert main(["compare", str(a / "run.json"), str(b / "run.json")]) == 0
    console = Console(record=True, width=160)
    rows = run_compare([str(a / "run.json"), str(b / "run.json")], console)
    by_key = {r["key"]: r for r in rows}
    assert by_key["request_throughput"]["ratio"] == pytest.approx(
        by_key["request_throughput"]["b"] / by_key["request_throughput"]["a"])
    assert "b/a" in console.export_text()


def test_find_max_load_via_cli(fake, tmp_path: Path):
    fake.state.token_delay_s = 0.0
    result = run_cli(fake, tmp_path, "--find-max-load", "--slo", "ttft_p99_ms=60000", "--max-load", "4",
                     "--requests", "4")
    search = result["find_max_load"]
    # The SLO always passes; only saturation (timing-dependent) may stop the search below the cap.
    points = search["points"]
    assert search["kind"] == "concurrency" and points[0]["value"] == 1
    assert search["best"] == max(p["value"] for p in points if p["passed"])
    assert [r["label"] for r in result["runs"]] == [f"c={p['value']}" for p in points]


def fake_measure(capacity: float, saturate_at: float | None = None):
    """A load point that meets its SLO up to ``capacity``; throughput flattens at ``saturate_at``."""
    calls: list[float] = []

    def measure(load: LoadConfig) -> dict:
        v = load.concurrency if load.request_rate is None else load.request_rate
        calls.append(v)
        tput = min(v, saturate_at) if saturate_at else v
        ttft = 10.0 * (v / saturate_at) ** 2 if saturate_at and v > saturate_at else 10.0
        summary = {"slo_met": v <= capacity, "output_token_throughput": tput,
                   "metrics": {"ttft_ms": {"p50": ttft}}}
        return {"label": str(v), "summary": summary}

    return measure, calls


def test_find_max_load_bisects_between_measured_points():
    measure, calls = fake_measure(capacity=11)
    report, runs = find_max_load(measure, LoadConfig(concurrency=1), "concurrency", start=1, max_value=64)
    assert report["best"] == 11 and report["first_failing"] == 12
    assert calls == [1, 2, 4, 8, 16, 12, 10, 11]
    assert len(runs) == len(calls)


def test_find_max_load_over_rates_stops_within_tolerance():
    measure, _ = fake_measure(capacity=5.3)
    report, _ = find_max_load(measure, LoadConfig(request_rate=1.0), "rate", start=1, max_value=64, rel_tol=0.05)
    assert 5.0 <= report["best"] <= 5.3 < report["first_failing"] <= 5.3 * 1.06


def test_find_max_load_stops_early_on_over_saturation():
    measure, calls = fake_measure(capacity=1000, saturate_at=4)
    report, _ = find_max_load(measure, LoadConfig(concurrency=1), "concurrency", start=1, max_value=256)
    assert report["stopped_on_saturation"] is True
    assert max(calls) == 8 and report["best"] < 8


def test_measurer_samples_kv_usage_during_the_run_and_keeps_whole_sessions(fake):
    fake.state.token_delay_s = 0.05  # three sequential turns of 5 tokens: >= 0.75 s, some 15 samples' worth
    w = MultiTurnWorkload(PromptBuilder(), turns_mean=3, user_isl=5, osl=5)
    measure = Measurer(ClientConfig(fake.url, "fake"), w, [], sample_interval_s=0.05)
    run = measure(LoadConfig(request_rate=20.0, max_requests=6))
    server = run["server_metrics"]
    assert server["derived"]["kv_cache_usage_max"] == 0.25
    assert server["during_run"]["vllm:kv_cache_usage_perc"]["samples"] >= 2
    assert server["counter_deltas"]["vllm:request_success_total"] == 6
    # a request budget buys whole conversations: 2 sessions x 3 turns, not 6 first turns
    records = measure.results[0].records
    assert sorted(r.turn for r in records) == [0, 0, 1, 1, 2, 2]
