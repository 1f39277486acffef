"""federate(): many workers' pages become one valid page with a worker label on every sample."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetllm.observability.federate import SCRAPE_OK, federate


def page(running: float, tokens: float, worker_label: str | None = None) -> str:
    r = CollectorRegistry()
    labels = ["model_name"] + (["worker"] if worker_label else [])
    values = ["m"] + ([worker_label] if worker_label else [])
    Gauge("vllm:num_requests_running", "Running.", labels, registry=r).labels(*values).set(running)
    Counter("vllm:generation_tokens", "Tokens.\nSecond line.", labels, registry=r).labels(*values).inc(tokens)
    Histogram("vllm:e2e_request_latency_seconds", "E2E.", labels, buckets=(1.0, 2.0), registry=r).labels(*values).observe(1.5)
    return generate_latest(r).decode()


def parsed(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_each_family_appears_once_with_every_workers_samples() -> None:
    out = federate({"w0": page(1, 10), "w1": page(2, 20)})
    assert out.count("# TYPE vllm:num_requests_running gauge") == 1
    assert out.count("# HELP vllm:generation_tokens_total Tokens.") == 1
    fams = parsed(out)
    running = {s.labels["worker"]: s.value for s in fams["vllm:num_requests_running"].samples}
    assert running == {"w0": 1, "w1": 2}
    tokens = {s.labels["worker"]: s.value for s in fams["vllm:generation_tokens"].samples if s.name.endswith("_total")}
    assert tokens == {"w0": 10, "w1": 20}
    assert fams["vllm:generation_tokens"].documentation == "Tokens.\nSecond line."


def test_histograms_keep_their_buckets_per_worker() -> None:
    fams = parsed(federate({"w0": page(0, 0), "w1": page(0, 0)}))
    fam = fams["vllm:e2e_request_latency_seconds"]
    assert fam.type == "histogram"
    inf = [s for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert sorted(s.labels["worker"] for s in inf) == ["w0", "w1"]


def test_a_clashing_worker_label_is_kept_as_exported_worker() -> None:
    fams = parsed(federate({"router-name": page(3, 0, worker_label="self-name"), "same": page(1, 0, worker_label="same")}))
    by = {s.labels["worker"]: s.labels for s in fams["vllm:num_requests_running"].samples}
    assert by["router-name"]["exported_worker"] == "self-name"
    assert "exported_worker" not in by["same"]


def test_unreadable_workers_are_reported_not_dropped() -> None:
    fams = parsed(federate({"up": page(0, 0), "down": None, "garbled": "this is { not prometheus"}))
    ok = {s.labels["worker"]: s.value for s in fams[SCRAPE_OK].samples}
    assert ok == {"up": 1, "down": 0, "garbled": 0}


def test_local_page_is_merged_without_a_worker_label() -> None:
    r = CollectorRegistry()
    Counter("fleetllm_router_requests", "Requests.", ["status"], registry=r).labels("200").inc(5)
    fams = parsed(federate({"w0": page(1, 1)}, local=generate_latest(r).decode()))
    (sample,) = [s for s in fams["fleetllm_router_requests"].samples if s.name.endswith("_total")]
    assert sample.labels == {"status": "200"} and sample.value == 5
    assert "vllm:num_requests_running" in fams


def test_fleet_metrics_reads_workers_concurrently_and_reports_the_dead_one() -> None:
    import asyncio

    import httpx

    from fleetllm.observability.federate import fleet_metrics

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dead":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, text=page(4, 0))

    async def go() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await fleet_metrics("", {"live": "http://live:1", "dead": "http://dead:1"}, client)

    fams = parsed(asyncio.run(go()))
    assert {s.labels["worker"]: s.value for s in fams[SCRAPE_OK].samples} == {"live": 1, "dead": 0}
    assert [s.value for s in fams["vllm:num_requests_running"].samples] == [4]
