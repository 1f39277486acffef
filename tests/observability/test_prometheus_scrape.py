"""A real Prometheus (Debian's) scraping two workers in two zones under `fleetllm bench` load answers
the operator's questions: TTFT p99, KV usage, prefix hit rate, request rate per zone. It also loads
deploy/prometheus.yml (promtool), runs every Grafana panel's query, and scrapes a federated page."""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from obs_tools import ROOT, Prometheus, need, run_bench

from fleetllm.observability.federate import federate

SENT = {"zone-a": 10, "zone-b": 6}


class FederatedPage:
    """Serves federate() of the given workers' live /metrics (what the router's /metrics will add)."""

    def __init__(self, workers: dict[str, str]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                texts = {n: httpx.get(u + "/metrics", timeout=5).text for n, u in workers.items()}
                body = federate(texts).encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def fleet(worker_factory: Any) -> dict[str, Any]:
    return {"zone-a": worker_factory("--zone", "zone-a", "--worker-id", "wa"),
            "zone-b": worker_factory("--zone", "zone-b", "--worker-id", "wb")}


@pytest.fixture(scope="module")
def prom(fleet: dict[str, Any], tmp_path_factory: Any) -> Iterator[Prometheus]:
    page = FederatedPage({"fed-a": fleet["zone-a"].base_url, "fed-b": fleet["zone-b"].base_url})
    config = Prometheus.scraping([w.base_url.removeprefix("http://") for w in fleet.values()])
    config["scrape_configs"].append({"job_name": "federated", "honor_labels": True,
                                     "static_configs": [{"targets": [page.target]}]})
    p = Prometheus(config)
    out = tmp_path_factory.mktemp("bench")
    loads = [
        threading.Thread(target=run_bench, args=(fleet["zone-a"].base_url, out / "a.json", "--workload", "shared-prefix",
                                                 "--num-prefixes", "2", "--prefix-len", "48", "--isl", "16", "--osl", "8",
                                                 "--concurrency", "3", "--requests", str(SENT["zone-a"]))),
        threading.Thread(target=run_bench, args=(fleet["zone-b"].base_url, out / "b.json", "--isl", "32", "--osl", "8",
                                                 "--concurrency", "2", "--requests", str(SENT["zone-b"]))),
    ]
    for t in loads:
        t.start()
    for t in loads:
        t.join()
    for w in fleet.values():
        w.wait_idle()
    # every request is in Prometheus' view before any assertion
    p.wait_for('sum by (zone) (vllm:request_success_total{job="fleetllm"})',
               lambda v: {dict(k)["zone"]: n for k, n in v.items()} == SENT)
    yield p
    p.stop()
    page.close()


def test_request_counts_per_zone_equal_requests_sent(prom: Prometheus) -> None:
    v = prom.vector('sum by (zone) (vllm:request_success_total{job="fleetllm"})')
    assert {dict(k)["zone"]: n for k, n in v.items()} == SENT


def test_per_zone_request_rate(prom: Prometheus) -> None:
    v = prom.vector('sum by (zone) (rate(vllm:request_success_total{job="fleetllm"}[5m]))')
    rates = {dict(k)["zone"]: r for k, r in v.items()}
    assert set(rates) == set(SENT) and all(r > 0 for r in rates.values())


def test_ttft_p99(prom: Prometheus) -> None:
    p99 = prom.scalar('histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{job="fleetllm"}[5m])))')
    p50 = prom.scalar('histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{job="fleetllm"}[5m])))')
    assert p99 is not None and p50 is not None
    assert 0 < p50 <= p99 <= 80  # inside the bucket range: an observed latency, not +Inf


def test_kv_usage_rose_under_load_and_is_zero_when_idle(prom: Prometheus) -> None:
    peak = prom.vector('max by (worker) (max_over_time(vllm:kv_cache_usage_perc{job="fleetllm"}[5m]))')
    assert {dict(k)["worker"] for k in peak} == {"wa", "wb"}
    assert all(0 < u <= 1 for u in peak.values())
    prom.wait_for('max(vllm:kv_cache_usage_perc{job="fleetllm"})', lambda v: list(v.values()) == [0.0])


def test_prefix_hit_rate(prom: Prometheus) -> None:
    rate = prom.scalar('sum(increase(vllm:prefix_cache_hits_total{job="fleetllm",zone="zone-a"}[5m]))'
                       ' / sum(increase(vllm:prefix_cache_queries_total{job="fleetllm",zone="zone-a"}[5m]))')
    assert rate is not None and 0 < rate < 1  # shared prefixes hit; each request's own suffix does not


def test_federated_page_is_one_target_with_every_worker(prom: Prometheus) -> None:
    v = prom.wait_for('sum by (worker, exported_worker) (vllm:request_success_total{job="federated"})',
                      lambda v: len(v) == 2)
    got = {(dict(k)["worker"], dict(k)["exported_worker"]): n for k, n in v.items()}
    assert got == {("fed-a", "wa"): SENT["zone-a"], ("fed-b", "wb"): SENT["zone-b"]}


def test_deploy_prometheus_config_is_valid() -> None:
    p = subprocess.run([need("promtool"), "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def grafana_exprs() -> list[tuple[str, str]]:
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_every_grafana_panel_query_runs(prom: Prometheus) -> None:
    exprs = grafana_exprs()
    assert len(exprs) >= 25
    assert any("histogram_quantile" in e for _, e in exprs) and any("rate(" in e for _, e in exprs)
    answered = 0
    for title, expr in exprs:
        concrete = re.sub(r"\$__rate_interval", "1m", expr)
        concrete = re.sub(r"\$(model|zone|worker)\b", ".*", concrete)
        assert "$" not in concrete, (title, concrete)
        got = prom.query(concrete)
        assert got["status"] == "success", (title, concrete, got)
        answered += bool(got["data"]["result"])
    assert answered >= 15  # most panels show data for a plain CPU fleet (router, GPU and spec panels need those)
