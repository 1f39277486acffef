"""The router's own Prometheus metrics (``fleetllm_router_*``), one registry per router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFB = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("fleetllm_router_decisions", "Routing decisions by policy, reason and chosen worker.",
                                 ["policy", "reason", "worker"], registry=r)
        self.inflight = Gauge("fleetllm_router_inflight", "Requests dispatched to a worker and not finished.",
                              ["worker"], registry=r)
        self.pending_prefill = Gauge("fleetllm_router_pending_prefill_tokens",
                                     "Uncached prompt tokens dispatched to a worker and still before their first byte.",
                                     ["worker"], registry=r)
        self.expected_output = Gauge("fleetllm_router_expected_output_tokens",
                                     "Output tokens per answer, the model's moving average: what the routing cost "
                                     "expects of a request that asks for more.", ["model"], registry=r)
        self.retries = Counter("fleetllm_router_retries", "Requests retried elsewhere after failing on this worker "
                               "before their first byte.", ["worker"], registry=r)
        self.breaker_open = Gauge("fleetllm_router_breaker_open", "1 while the worker's circuit breaker is open.",
                                  ["worker"], registry=r)
        self.breaker_trips = Counter("fleetllm_router_breaker_trips", "Times the worker's circuit breaker opened.",
                                     ["worker"], registry=r)
        self.healthy = Gauge("fleetllm_router_worker_healthy", "1 while the worker passes health checks.",
                             ["worker", "zone"], registry=r)
        self.requests = Counter("fleetllm_router_requests", "Requests answered by the router, by HTTP status.",
                                ["status"], registry=r)
        self.errors = Counter("fleetllm_router_request_errors", "Failures seen by the router, by kind.",
                              ["kind"], registry=r)
        self.zone_requests = Counter("fleetllm_router_zone_requests", "Requests dispatched per worker zone.",
                                     ["zone"], registry=r)
        self.ttfb = Histogram("fleetllm_router_time_to_first_byte_seconds",
                              "Request arrival at the router to the first response byte from a worker.",
                              buckets=_TTFB, registry=r)
        self.cached_tokens = Counter("fleetllm_router_estimated_cached_tokens",
                                     "Prompt tokens the router expected the chosen worker to have cached.", registry=r)
        self._add_pd_metrics(r)
        self.prompt_tokens = Counter("fleetllm_router_prompt_tokens", "Prompt tokens of routed requests (router-side "
                                     "tokenization).", registry=r)
        self.model_requests = Counter("fleetllm_router_model_requests", "Requests routed per served model.",
                                      ["model"], registry=r)
        self.lora_requests = Counter("fleetllm_router_lora_requests", "Requests for a LoRA adapter (vLLM's lora_name) "
                                     "by base model, sent to a copy holding it resident (resident=true) or not.",
                                     ["model", "lora_name", "resident"], registry=r)
        self.variant_requests = Counter("fleetllm_router_variant_requests", "Requests sent to each variant of a "
                                        "split model (canary).", ["model", "variant"], registry=r)
        self.variant_responses = Counter("fleetllm_router_variant_responses", "Answers of each variant of a split "
                                         "model, by HTTP status.", ["model", "variant", "status"], registry=r)
        self.variant_ttfb = Histogram("fleetllm_router_variant_time_to_first_byte_seconds", "Arrival to first byte "
                                      "per variant of a split model.", ["model", "variant"], buckets=_TTFB, registry=r)
        self.held = Gauge("fleetllm_router_held_requests", "Requests held while a copy of their model starts "
                          "(scale from zero).", ["model"], registry=r)
        self.cold_start = Histogram("fleetllm_router_cold_start_seconds", "How long a request was held for a copy "
                                    "of its model to start.", ["model"], buckets=_TTFB + (160.0, 320.0), registry=r)
        self.desired = Gauge("fleetllm_autoscaler_desired_replicas", "Copies the autoscaler wants per model.",
                             ["model"], registry=r)
        self.scale_decisions = Counter("fleetllm_autoscaler_decisions", "Autoscaler decisions per model, by direction "
                                       "(up, down, none) and the signal that decided.", ["model", "direction", "reason"],
                                       registry=r)

    def _add_pd_metrics(self, r: CollectorRegistry) -> None:
        """Disaggregated prefill/decode: placement decisions, estimates and the transfer."""
        self.pd_decisions = Counter("fleetllm_router_pd_decisions", "Prefill placement per request: disaggregated "
                                    "(remote prefill + KV transfer), local (below the threshold), saturated (no "
                                    "prefill worker free), fallback (the remote leg failed; prefilled locally), "
                                    "cancelled (the request ended first).",
                                    ["decision"], registry=r)
        self.pd_seconds = Histogram("fleetllm_router_pd_prefill_seconds", "Remote prefill plus KV transfer, until the "
                                    "prefill worker answered.", buckets=_TTFB, registry=r)
        self.pd_auto = Counter("fleetllm_router_pd_auto_decisions", "--pd-threshold auto: requests whose estimates "
                               "favoured the P/D path (disaggregated) or a local prefill (local).", ["decision"],
                               registry=r)
        self.pd_estimate = Histogram("fleetllm_router_pd_estimate_seconds", "--pd-threshold auto: each decision's "
                                     "estimates in request-seconds of delay: local_stall (a local prefill's stall of "
                                     "the decode worker's running requests), remote (the P/D path's), transfer.",
                                     ["side", "decision"], buckets=_TTFB, registry=r)
        self.pd_prefill_rate = Gauge("fleetllm_router_pd_prefill_tokens_per_second", "Prefill rate measured from "
                                     "remote prefills, per prefill worker.", ["worker"], registry=r)
        self.pd_bandwidth = Gauge("fleetllm_router_pd_bandwidth_bytes_per_second", "KV transfer bandwidth measured "
                                  "from remote prefills (bytes / transfer seconds, moving average).", registry=r)
        self.pd_bytes = Counter("fleetllm_router_pd_transfer_bytes", "KV bytes shipped prefill -> decode.", registry=r)
