"""Engine metrics in Prometheus form, with vLLM-compatible names (one registry per engine)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.labels = {"model_name": model_name}
        lab = self.labels

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(**lab)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(**lab)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**lab)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time from arrival to first schedule.", _E2E)
        fin = Counter("vllm:request_success", "Finished requests by reason.", ["model_name", "finished_reason"], registry=r)
        self._finished = fin
        self._model = model_name
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Verify steps that carried draft tokens.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position (0-based).",
            ["model_name", "position"], registry=r,
        )
        self._spec_seen = (0, 0, 0, [])

    def spec_sync(self, spec: Any) -> None:
        """Bring the speculative decoding counters up to ``spec``'s totals (a SpecDecoder)."""
        drafts, tokens, accepted, per_pos = self._spec_seen
        self.spec_drafts.inc(spec.num_drafts - drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens - tokens)
        self.spec_accepted.inc(spec.num_accepted - accepted)
        for pos, n in enumerate(spec.accepted_per_pos):
            seen = per_pos[pos] if pos < len(per_pos) else 0
            if n > seen:
                self._spec_per_pos.labels(model_name=self._model, position=str(pos)).inc(n - seen)
        self._spec_seen = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted, list(spec.accepted_per_pos))

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._model, finished_reason=reason).inc()
