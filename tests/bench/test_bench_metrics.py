"""Metric formulas on hand-computed timings, statistics, SLO parsing, goodput and server deltas."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.bench.client import RequestRecord
from fleetllm.bench.metrics import chunk_gaps_ms, parse_slos, request_metrics, stats, summarize
from fleetllm.bench.server_metrics import diff, parse_prometheus

MS = 1_000_000


def record(start_ms: float, chunks_ms: list[float], end_ms: float, out_tokens: int | None = None, *,
           error: str | None = None, cancelled: bool = False, rid: int = 0, in_tokens: int = 10) -> RequestRecord:
    return RequestRecord(
        request_id=rid, session_id=f"s{rid}", turn=0, max_tokens=16, expected_input_tokens=None,
        scheduled_ns=int(start_ms * MS), start_ns=int(start_ms * MS), end_ns=int(end_ms * MS),
        chunk_ns=[int(c * MS) for c in chunks_ms], input_tokens=in_tokens,
        output_tokens=len(chunks_ms) if out_tokens is None else out_tokens, error=error, cancelled=cancelled)


def test_per_request_formulas_match_hand_computed_timings():
    # sent at 0, chunks at 100/120/150/200 ms, stream closed at 210 ms, 4 tokens (one per chunk)
    m = request_metrics(record(0, [100, 120, 150, 200], 210))
    assert m["ttft_ms"] == pytest.approx(100)
    assert m["ttst_ms"] == pytest.approx(20)  # second chunk − first chunk
    assert m["itl_ms"] == pytest.approx((200 - 100) / 3)  # mean chunk gap of the request
    assert m["tpot_ms"] == pytest.approx((210 - 100) / 3)  # (E2E − TTFT) / (tokens − 1)
    assert m["e2e_ms"] == pytest.approx(210)
    assert m["output_tps_per_user"] == pytest.approx(3 / 0.110)


def test_tpot_counts_tokens_while_itl_counts_chunks():
    # 7 tokens in 4 chunks (e.g. speculative decoding): TPOT per token is smaller than the chunk gap
    m = request_metrics(record(0, [100, 120, 150, 200], 210, out_tokens=7))
    assert m["itl_ms"] == pytest.approx(100 / 3)
    assert m["tpot_ms"] == pytest.approx(110 / 6)


@given(ttft=st.integers(1, 10**9), gaps=st.lists(st.integers(0, 10**8), min_size=1, max_size=50),
       tail=st.integers(0, 10**7))
def test_metric_identities_hold_for_any_timings(ttft, gaps, tail):
    chunks = [ttft]
    for g in gaps:
        chunks.append(chunks[-1] + g)
    rec = RequestRecord(request_id=0, session_id="s", turn=0, max_tokens=1, expected_input_tokens=None,
                        scheduled_ns=0, start_ns=0, end_ns=chunks[-1] + tail, chunk_ns=chunks,
                        output_tokens=len(chunks))
    m = request_metrics(rec)
    assert m["ttft_ms"] <= m["e2e_ms"]
    assert sum(chunk_gaps_ms(rec)) == pytest.approx(m["itl_ms"] * (len(chunks) - 1))
    if m["tpot_ms"] is not None:  # one token per chunk: TPOT differs from ITL only by the stream's tail
        assert m["tpot_ms"] * (len(chunks) - 1) == pytest.approx(m["itl_ms"] * (len(chunks) - 1) + tail / MS)


def test_single_token_output_has_no_itl_or_tpot():
    m = request_metrics(record(0, [50], 55))
    assert m["ttft_ms"] == pytest.approx(50)
    assert m["itl_ms"] is None and m["tpot_ms"] is None and m["ttst_ms"] is None


def test_chunk_gaps_are_every_consecutive_gap():
    assert chunk_gaps_ms(record(0, [100, 120, 150, 200], 210)) == pytest.approx([20, 30, 50])


def test_stats_percentiles_and_moments():
    s = stats([1.0, 2.0, 3.0, 4.0])
    assert s["count"] == 4 and s["mean"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0
    assert s["std"] == pytest.approx(math.sqrt(1.25))
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)  # linear interpolation: 1 + 0.9 * 3
    assert stats([])["p99"] is None


def test_summary_throughputs_use_the_span_of_the_requests():
    recs = [record(0, [100, 200], 1000, rid=0, in_tokens=10), record(500, [600, 700], 2000, rid=1, in_tokens=30)]
    s = summarize(recs, 0, 0)
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_token_throughput"] == pytest.approx(20.0)
    assert s["output_token_throughput"] == pytest.approx(2.0)
    assert s["metrics"]["chunk_gap_ms"]["count"] == 2


def test_errors_and_cancellations_are_counted_and_kept_out_of_latencies():
    recs = [record(0, [100, 200], 300, rid=0), record(0, [], 50, error="http_500", rid=1),
            record(0, [], 70, error="timeout", rid=2), record(0, [10], 20, cancelled=True, rid=3)]
    s = summarize(recs, 0, 0)
    assert s["requests"] == {"total": 4, "completed": 1, "errors": 2, "cancelled": 1}
    assert s["errors_by_kind"] == {"http_500": 1, "timeout": 1}
    assert s["metrics"]["ttft_ms"]["count"] == 1


def test_goodput_and_attainment_count_errors_against_the_slo():
    recs = [record(0, [100, 200], 300, rid=0), record(0, [900, 950], 1000, rid=1),
            record(0, [], 50, error="http_500", rid=2), record(0, [100, 110], 120, rid=3)]
    s = summarize(recs, 0, 0, parse_slos("ttft_ms=500"))
    assert s["slo_attainment"] == pytest.approx(2 / 4)
    assert s["goodput"] == pytest.approx(2 / 1.0)


def test_aggregate_slo_checks_and_errors_fail_slo_met():
    recs = [record(0, [100, 200], 300, rid=i) for i in range(5)]
    assert summarize(recs, 0, 0, parse_slos("ttft_p99_ms=150"))["slo_met"] is True
    assert summarize(recs, 0, 0, parse_slos("ttft_p99_ms=50"))["slo_met"] is False
    with_error = recs + [record(0, [], 10, error="http_503", rid=9)]
    assert summarize(with_error, 0, 0, parse_slos("ttft_p99_ms=150"))["slo_met"] is False


def test_parse_slos_splits_per_request_and_aggregate_limits():
    limits = parse_slos("ttft_ms=500, tpot_ms=50,ttft_p99_ms=800,itl_p99_ms=100")
    assert [(s.metric, s.stat, s.limit) for s in limits] == [
        ("ttft_ms", None, 500), ("tpot_ms", None, 50), ("ttft_ms", "p99", 800), ("itl_ms", "p99", 100)]
    with pytest.raises(ValueError):
        parse_slos("latency_ms=3")


PROM_BEFORE = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{worker="a"} 100
vllm:prefix_cache_queries_total{worker="b"} 100
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{worker="a"} 10
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total 0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total 0
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc 0.0
"""
PROM_AFTER = PROM_BEFORE.replace("} 100", "} 300").replace("} 10\n", "} 210\n") \
    .replace("draft_tokens_total 0", "draft_tokens_total 80").replace("accepted_tokens_total 0", "accepted_tokens_total 60") \
    .replace("drafts_total 0", "drafts_total 20").replace("perc 0.0", "perc 0.5")


def test_server_metric_deltas_and_derived_rates():
    d = diff(parse_prometheus(PROM_BEFORE), parse_prometheus(PROM_AFTER))
    assert d is not None
    assert d["counter_deltas"]["vllm:prefix_cache_queries_total"] == 400  # summed over workers
    assert d["derived"]["prefix_cache_hit_rate"] == pytest.approx(200 / 400)
    assert d["derived"]["spec_acceptance_rate"] == pytest.approx(60 / 80)
    assert d["derived"]["spec_mean_acceptance_length"] == pytest.approx(1 + 60 / 20)
    assert d["gauges"]["vllm:kv_cache_usage_perc"] == {"before": 0.0, "after": 0.5}


def test_server_metrics_absent_gives_none():
    assert diff(None, parse_prometheus(PROM_AFTER)) is None
