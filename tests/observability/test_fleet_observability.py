"""A local fleet (`fleetllm serve`: a router and two workers in zones a and b) as an operator sees it.

A real Prometheus (Debian's) scrapes the router alone, whose /metrics carries its own series and both
workers' (federated, worker-labelled), while `fleetllm bench` loads it; PromQL then answers TTFT p99,
KV usage, prefix hit rate and request rate per zone. deploy/prometheus.yml passes promtool and every
Grafana panel's query runs. Headless Chromium opens the router's /dashboard during a second load: each
view renders with data, a screenshot per view is saved, and the page logs no console errors.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from obs_tools import ROOT, Fleet, Prometheus, artifacts_dir, chromium, need, points, run_bench
from otlp_sink import OTLPSink

SENT = 12  # requests of the first load; round robin puts half in each zone
# 64 output tokens each: every worker holds KV blocks for seconds, over several of Prometheus' 1 s scrapes (with 8
# the whole load could fall between two scrapes of one worker's KV usage on a busy machine)
pytestmark = pytest.mark.slow  # a `fleetllm serve` fleet, Prometheus and Chromium

FLEET = {"policy": "round_robin",
         "machines": [{"name": "a", "cores": 1, "zone": "zone-a"}, {"name": "b", "cores": 1, "zone": "zone-b"}],
         # simulated copies: the real scheduler, prefix cache, metrics and logs, with a timing model for the
         # weights (what is observed here does not depend on them)
         "models": [{"source": "smollm2-135m", "simulate": True, "replicas": 2, "engine": {"sim_speed": 2}}]}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet(FLEET, replicas=2)
    yield f
    f.stop()


@pytest.fixture(scope="module")
def prom(fleet: Fleet, tmp_path_factory: Any) -> Iterator[Prometheus]:
    config = Prometheus.scraping([fleet.url.removeprefix("http://")])
    config["scrape_configs"][0]["honor_labels"] = True  # the worker label the router set
    p = Prometheus(config)
    # rates need a sample from before the load: on a busy machine Prometheus may start scraping late,
    # after a short load has already finished, and every increase() would then be 0
    p.wait_for("sum(vllm:request_success_total)", lambda v: list(v.values()) == [0.0], deadline_s=60)
    run_bench(fleet.url, tmp_path_factory.mktemp("bench") / "load.json", "--workload", "shared-prefix",
              "--num-prefixes", "2", "--prefix-len", "48", "--isl", "16", "--osl", "64", "--concurrency", "3",
              "--requests", str(SENT))
    p.wait_for("sum(vllm:request_success_total)", lambda v: list(v.values()) == [SENT], deadline_s=60)
    yield p
    p.stop()


def test_one_target_carries_the_router_and_every_worker(prom: Prometheus, fleet: Fleet) -> None:
    names = {u.removeprefix("http://") for u in fleet.worker_urls}
    ok = prom.vector("fleetllm_federate_scrape_ok")
    assert {dict(k)["worker"] for k in ok} == names and set(ok.values()) == {1.0}
    assert prom.scalar('sum(fleetllm_router_requests_total{status="200"})') == SENT
    assert {dict(k)["worker"] for k in prom.vector("vllm:num_requests_running")} == names


def test_request_counts_per_zone_equal_requests_sent(prom: Prometheus) -> None:
    by_zone = {dict(k)["zone"]: n for k, n in prom.vector("sum by (zone) (vllm:request_success_total)").items()}
    assert by_zone == {"zone-a": SENT / 2, "zone-b": SENT / 2}


def test_per_zone_request_rate(prom: Prometheus) -> None:
    v = prom.vector("sum by (zone) (rate(vllm:request_success_total[5m]))")
    rates = {dict(k)["zone"]: r for k, r in v.items()}
    assert set(rates) == {"zone-a", "zone-b"} and all(r > 0 for r in rates.values())


def test_ttft_p99(prom: Prometheus) -> None:
    q = "histogram_quantile({}, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))"
    p50, p99 = prom.scalar(q.format(0.5)), prom.scalar(q.format(0.99))
    assert p50 is not None and p99 is not None
    assert 0 < p50 <= p99 <= 80  # an observed latency inside the bucket range, not +Inf or NaN


def test_kv_usage_rose_under_load_and_is_zero_when_idle(prom: Prometheus, fleet: Fleet) -> None:
    peak = prom.vector("max by (worker) (max_over_time(vllm:kv_cache_usage_perc[5m]))")
    assert len(peak) == 2 and all(0 < u <= 1 for u in peak.values())
    prom.wait_for("max(vllm:kv_cache_usage_perc)", lambda v: list(v.values()) == [0.0])


def test_prefix_hit_rate(prom: Prometheus) -> None:
    rate = prom.scalar("sum(increase(vllm:prefix_cache_hits_total[5m])) / sum(increase(vllm:prefix_cache_queries_total[5m]))")
    assert rate is not None and 0 < rate < 1  # the shared prefixes hit; each request's own suffix does not


def test_request_id_and_trace_reach_the_workers_log_through_the_router(fleet: Fleet) -> None:
    trace = "0af7651916cd43dd8448eb211c80319c"
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120,
                   headers={"x-request-id": "fleet-rid-7", "traceparent": f"00-{trace}-b7ad6b7169203331-01"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "fleet-rid-7"
    def workers_log() -> str:  # simulated copies log per process (sim-PORT.log), real ones per worker
        return "".join(p.read_text() for p in fleet.log_dir.glob("*.log") if p.name != "router.log")

    deadline = time.monotonic() + 30
    while "fleet-rid-7" not in workers_log() and time.monotonic() < deadline:
        time.sleep(0.2)
    (line,) = [ln for ln in workers_log().splitlines() if "fleet-rid-7" in ln]
    assert f"trace={trace}" in line and "status=200" in line


def test_deploy_prometheus_config_is_valid() -> None:
    p = subprocess.run([need("promtool"), "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_grafana_panel_query_runs(prom: Prometheus) -> None:
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 30
    assert any("histogram_quantile" in e for _, e in exprs) and any("rate(" in e for _, e in exprs)
    answered = 0
    for title, expr in exprs:
        concrete = re.sub(r"\$__rate_interval", "1m", expr)
        concrete = re.sub(r"\$(model|zone|worker)\b", ".*", concrete)
        assert "$" not in concrete, (title, concrete)
        got = prom.query(concrete)
        assert got["status"] == "success", (title, concrete, got)
        answered += bool(got["data"]["result"])
    assert answered >= 20  # a CPU fleet without speculation or failures leaves the rest empty


# ---- the dashboard ----------------------------------------------------------------------------------
# cards each view must fill for this fleet (retries, breaker trips and speculation stay empty: none happen)
MUST_HAVE_DATA = {
    "performance": ["ttft", "itl", "e2e", "throughput", "requests", "phases", "ttfb"],
    "capacity": ["kv", "running", "waiting", "load", "zones", "replica_tps", "prefix", "decisions", "cpu"],
    "reliability": ["errors", "status", "health", "coldstart", "tenant_requests", "tenant_queue"],
}

# the page's own Prometheus text parser on escapes, +Inf, NaN and a sample without labels
PARSE_CHECK = r"""
const text = String.raw`x{a="a \"quoted\"\\path\nline",le="+Inf"} +Inf` + "\ny{a=\"b\"} NaN\nz 3\n# HELP z z\n";
const m = window.fleetDashboard.parseMetrics(text);
const x = m.get("x")[0];
return {label: x.labels.a, inf: String(x.value), nan: Number.isNaN(m.get("y")[0].value), bare: m.get("z")[0].value};
"""


def test_dashboard_renders_three_views_with_data_and_no_console_errors(fleet: Fleet, prom: Prometheus,
                                                                        tmp_path: Any) -> None:
    r = httpx.get(fleet.url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http://" not in r.text and "https://" not in r.text  # self-contained: nothing loaded from elsewhere
    shots = artifacts_dir("dashboard")
    with chromium() as driver:
        driver.get(fleet.url + "/dashboard?interval=500&window=20#performance")
        load = threading.Thread(target=run_bench, args=(fleet.url, tmp_path / "load.json", "--concurrency", "4",
                                                        "--requests", "12", "--isl", "48", "--osl", "12"))
        load.start()
        load.join()
        time.sleep(1.5)  # a few more scrapes after the load
        assert driver.execute_script("return window.fleetDashboard.scrapes") > 5
        for view, cards in MUST_HAVE_DATA.items():
            driver.find_element("css selector", f'#tabs a[data-view="{view}"]').click()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(points(driver, c) > 0 for c in cards):
                time.sleep(0.25)
            assert driver.find_element("id", "view").get_attribute("data-view") == view
            empty = [c for c in cards if points(driver, c) == 0]
            assert not empty, f"{view}: no data in {empty}"
            driver.save_screenshot(str(shots / f"{view}.png"))
            assert (shots / f"{view}.png").stat().st_size > 10_000
        health_rows = driver.execute_script("return document.querySelectorAll('#card-health tr').length")
        assert health_rows == 3  # a header and both workers
        assert driver.execute_script("return window.fleetDashboard.lastError") is None
        parsed = driver.execute_script(PARSE_CHECK)
        assert parsed == {"label": 'a "quoted"\\path\nline', "inf": "Infinity", "nan": True, "bare": 3}
        logs = driver.get_log("browser")
    errors = [e for e in logs if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors


def test_serve_with_otlp_pushes_router_and_worker_metrics_and_spans(tmp_path: Any) -> None:
    """`fleetllm serve` with otlp_endpoint: the router and every (simulated) worker push to one collector."""
    sink = OTLPSink()
    f = Fleet({"policy": "round_robin", "otlp_endpoint": sink.url,
               "router_args": ["--otlp-interval", "0.5"],
               "machines": [{"zone": "sim-zone"}],
               "models": [{"source": "smollm2-135m", "simulate": True, "replicas": 2, "engine": {"otlp_interval": 0.5}}]},
              replicas=2)
    try:
        for i in range(2):
            r = httpx.post(f.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 3}, timeout=60,
                           headers={"x-request-id": f"otlp-fleet-{i}"})
            assert r.status_code == 200

        def services() -> dict[str, set[str]]:
            seen: dict[str, set[str]] = {}
            for req in sink.metrics():
                for rm in req.resource_metrics:
                    svc = next(a.value.string_value for a in rm.resource.attributes if a.key == "service.name")
                    seen.setdefault(svc, set()).update(m.name for sm in rm.scope_metrics for m in sm.metrics)
            return seen

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = services()
            spans = {a.value.string_value for s in sink.spans() for a in s.attributes if a.key == "fleetllm.request_id"}
            if ("fleetllm_router_requests" in got.get("fleetllm-router", set())
                    and "gen_ai.server.request.duration" in got.get("fleetllm-worker", set())
                    and {"otlp-fleet-0", "otlp-fleet-1"} <= spans):
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"the collector did not get router + worker metrics and both spans: {services()}")
    finally:
        f.stop()
        sink.close()
