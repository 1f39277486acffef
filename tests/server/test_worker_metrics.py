"""The worker's /metrics as a specification: vLLM and OpenTelemetry GenAI names with the worker's
identity labels, values that equal what a client sent and measured, process/host and cold-start series,
and the request id in the log. Latencies are compared with the client's, never with fixed numbers."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetllm.engine.metrics import GENAI_DURATION, GENAI_TOKENS, GENAI_TPOT, GENAI_TTFT

IDENTITY = {"worker": "w-test", "role": "both", "zone": "zone-a", "instance_type": "test-box"}


@pytest.fixture(scope="module")
def labelled(worker_factory: Any) -> Any:
    return worker_factory("--worker-id", "w-test", "--zone", "zone-a", "--instance-type", "test-box")


def families(base_url: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(base_url + "/metrics").text)}


def value(fams: dict[str, Any], sample: str, **labels: str) -> float:
    """Sum of the samples named ``sample`` whose labels include ``labels``."""
    family = fams[sample.removesuffix("_total").removesuffix("_sum").removesuffix("_count")]
    return sum(s.value for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def bucket_bounds(fams: dict[str, Any], name: str) -> tuple[float, ...]:
    les = {float(s.labels["le"]) for s in fams[name].samples if s.name == name + "_bucket"}
    return tuple(sorted(le for le in les if le != float("inf")))


def test_every_series_carries_the_worker_identity(labelled: Any) -> None:
    fams = families(labelled.base_url)
    for fam in fams.values():
        if fam.name.startswith(("vllm:", "gen_ai_", "fleetllm_")):
            for s in fam.samples:
                assert {k: s.labels.get(k) for k in IDENTITY} == IDENTITY, s
                assert s.labels["model_name"] == "smollm2-135m"


def test_vllm_and_genai_histograms_are_exposed(labelled: Any) -> None:
    fams = families(labelled.base_url)
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):
        assert fams[name].type == "histogram", name
    for name in ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:request_success"):
        assert fams[name].type == "counter", name


def test_genai_histograms_use_the_semantic_convention_buckets(labelled: Any) -> None:
    fams = families(labelled.base_url)
    assert bucket_bounds(fams, "gen_ai_server_time_to_first_token_seconds") == GENAI_TTFT
    assert bucket_bounds(fams, "gen_ai_server_time_per_output_token_seconds") == GENAI_TPOT
    assert bucket_bounds(fams, "gen_ai_server_request_duration_seconds") == GENAI_DURATION
    assert bucket_bounds(fams, "gen_ai_client_token_usage") == GENAI_TOKENS
    assert GENAI_TTFT[:3] == (0.001, 0.005, 0.01) and GENAI_DURATION[-1] == 81.92


def test_process_host_and_cold_start_series(labelled: Any) -> None:
    fams = families(labelled.base_url)
    assert value(fams, "process_resident_memory_bytes") > 10e6
    assert value(fams, "process_cpu_seconds_total") > 0
    assert 0 <= value(fams, "fleetllm_host_cpu_utilization_ratio") <= 1
    assert value(fams, "fleetllm_host_memory_total_bytes") > 0
    phases = {s.labels["phase"]: s.value for s in fams["fleetllm_worker_cold_start_seconds"].samples}
    assert set(phases) == {"weight_load", "warm_up", "ready"}
    assert phases["weight_load"] > 0 and phases["warm_up"] > 0
    assert phases["ready"] > phases["weight_load"] + phases["warm_up"]  # ready counts from process start


def stream_and_time(base_url: str, prompt: str, max_tokens: int, rid: str) -> dict[str, Any]:
    """One streamed completion: the client's TTFT and E2E and the usage the server reported."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    ttft = None
    usage = None
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120,
                      headers={"x-request-id": rid}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.monotonic() - t0
            if '"usage"' in line and '"prompt_tokens"' in line:
                usage = httpx.Response(200, content=line[6:]).json()["usage"]
    return {"ttft": ttft, "e2e": time.monotonic() - t0, "usage": usage}


def test_values_equal_what_the_client_sent_and_measured(labelled: Any) -> None:
    labelled.wait_idle()
    before = families(labelled.base_url)
    runs = [stream_and_time(labelled.base_url, p, 6, f"obs-{i}")
            for i, p in enumerate(["Count to three:", "Name a colour:", "Say hi:"])]
    after_m = labelled.wait_idle()
    after = families(labelled.base_url)

    def delta(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    n = len(runs)
    prompt = sum(r["usage"]["prompt_tokens"] for r in runs)
    output = sum(r["usage"]["completion_tokens"] for r in runs)
    assert delta("vllm:request_success_total") == n
    for hist in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "gen_ai_server_request_duration_seconds", "gen_ai_server_time_to_first_token_seconds"):
        assert delta(hist + "_count") == n, hist
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == output
    assert delta("gen_ai_client_token_usage_sum", gen_ai_token_type="input") == prompt
    assert delta("gen_ai_client_token_usage_sum", gen_ai_token_type="output") == output
    assert delta("vllm:inter_token_latency_seconds_count") == output - n
    assert delta("vllm:time_per_output_token_seconds_count") == output - n
    # The server's clock starts after the request reached it and stops before the last bytes left, so
    # its sums never exceed the client's. The lower bound only catches unit errors (milliseconds counted
    # as seconds would be 1,000x off): how much lower the server's share is depends on how loaded the
    # machine is (the client shares this process's GIL with the worker; on CI's 2 busy cores the
    # server's TTFT was a fifth of the client's), which a test must not assume.
    client_e2e, client_ttft = sum(r["e2e"] for r in runs), sum(r["ttft"] for r in runs)
    server_e2e = delta("vllm:e2e_request_latency_seconds_sum")
    server_ttft = delta("vllm:time_to_first_token_seconds_sum")
    assert 0.01 * client_e2e < server_e2e <= client_e2e
    assert 0.01 * client_ttft < server_ttft <= client_ttft
    phases = sum(delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert phases == pytest.approx(server_e2e, rel=1e-6, abs=1e-6)  # the phases tile the request
    assert after_m["vllm:kv_cache_usage_perc"] == 0


def test_finished_reason_labels(labelled: Any) -> None:
    before = families(labelled.base_url)
    stream_and_time(labelled.base_url, "Tell me a long story about the sea.", 3, "obs-length")
    labelled.wait_idle()
    after = families(labelled.base_url)
    reason = {"finished_reason": "length"}
    assert value(after, "vllm:request_success_total", **reason) - value(before, "vllm:request_success_total", **reason) == 1


def test_the_request_id_is_in_the_log(labelled: Any) -> None:
    stream_and_time(labelled.base_url, "Hello", 2, "find-me-in-the-log-42")
    deadline = time.monotonic() + 30
    while "find-me-in-the-log-42" not in labelled.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(ln for ln in labelled.log().splitlines() if "find-me-in-the-log-42" in ln)
    assert "output_tokens=2" in line and "finish=length" in line


@pytest.mark.slow  # a worker of its own
def test_disable_metrics_records_nothing(worker_factory: Any) -> None:
    quiet = worker_factory("--disable-metrics", "--disable-log-requests")
    stream_and_time(quiet.base_url, "Hello", 2, "quiet-1")
    fams = families(quiet.base_url)
    assert value(fams, "vllm:request_success_total") == 0
    assert value(fams, "vllm:generation_tokens_total") == 0
    assert "quiet-1" not in quiet.log()
