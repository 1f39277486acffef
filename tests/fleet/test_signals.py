"""Autoscaler signals read from real Prometheus pages (written by prometheus_client, as workers do)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleetllm.fleet.signals import model_signals, quantile

BUCKETS = (0.1, 0.2, 0.5, 1.0, 2.0)


class FakeWorker:
    """The worker metrics the autoscaler reads, under their vLLM names."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("vllm:num_requests_waiting", "", ["model_name"], registry=r).labels("m")
        self.running = Gauge("vllm:num_requests_running", "", ["model_name"], registry=r).labels("m")
        self.kv = Gauge("vllm:kv_cache_usage_perc", "", ["model_name"], registry=r).labels("m")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "", ["model_name"], buckets=BUCKETS,
                              registry=r).labels("m")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "", ["model_name"], buckets=BUCKETS,
                             registry=r).labels("m")
        self.done = Counter("vllm:request_success", "", ["model_name", "finished_reason"], registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "", ["model_name"], buckets=BUCKETS,
                             registry=r).labels("m")

    def page(self) -> str:
        return generate_latest(self.registry).decode()


def test_quantile_interpolates_inside_a_bucket_like_prometheus():
    assert quantile(0.5, {1.0: 0, 2.0: 10, float("inf"): 10}) == pytest.approx(1.5)
    assert quantile(0.9, {1.0: 10, float("inf"): 10}) == pytest.approx(0.9)
    assert quantile(0.9, {1.0: 0, float("inf"): 0}) is None
    assert quantile(0.9, {1.0: 3, float("inf"): 3}, min_count=10) is None  # too few to be a percentile


def test_signals_sum_queues_average_kv_and_take_latency_percentiles_since_the_last_read():
    a, b = FakeWorker(), FakeWorker()
    for _ in range(50):
        a.ttft.observe(0.05)  # before the window: must not count
    before = {"a": a.page(), "b": b.page()}
    for _ in range(9):
        a.ttft.observe(0.15)
    b.ttft.observe(1.5)
    for _ in range(10):
        a.done.labels("m", "stop").inc()
        a.e2e.observe(1.5)  # 10 requests of 1.5 s in 5 s: 3 in the system on average
    a.waiting.set(3)
    b.waiting.set(4)
    b.running.set(2)
    a.kv.set(0.2)
    b.kv.set(0.6)
    s = model_signals(before, {"a": a.page(), "b": b.page()}, dt=5.0, held=1)
    assert (s.copies, s.waiting, s.running, s.held) == (2, 7, 2, 1)
    assert s.kv_usage == pytest.approx(0.4)
    assert s.request_rate == pytest.approx(2.0)
    assert s.concurrency == pytest.approx(3.0)
    assert 0.1 < s.ttft_p90_s <= 0.2  # 9 of 10 observations in the window were 0.15 s
    assert s.itl_p90_s is None


def test_a_copy_that_just_started_counts_for_gauges_only():
    a = FakeWorker()
    a.waiting.set(2)
    a.ttft.observe(0.3)
    s = model_signals({}, {"new": a.page()}, dt=5.0)
    assert (s.copies, s.waiting, s.ttft_p90_s, s.concurrency) == (1, 2, None, None)


def test_no_copies_means_zero_copies_and_the_held_requests():
    s = model_signals({}, {}, dt=5.0, held=3)
    assert (s.copies, s.held) == (0, 3)


def test_requests_in_flight_per_lora_adapter_are_summed_over_copies_by_adapter():
    pages = {}
    for url, counts in (("a", {"sql": 3, "chat": 1}), ("b", {"sql": 2})):
        w = FakeWorker()
        g = Gauge("fleetllm:lora_requests_in_flight", "", ["model_name", "lora_name"], registry=w.registry)
        for name, n in counts.items():
            g.labels("m", name).set(n)
        pages[url] = w.page()
    assert model_signals(pages, pages, dt=5.0).adapters == {"sql": 5.0, "chat": 1.0}
