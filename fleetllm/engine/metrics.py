"""Engine metrics in Prometheus form: vLLM-compatible names plus the OpenTelemetry GenAI server metrics.

One registry per engine. Every series carries the same constant labels: ``model_name`` (vLLM's name for
the model label) and the worker's identity (``worker``, ``role``, ``zone``, ``instance_type``), so a
fleet's series can be told apart and summed by zone or instance type.

The engine reports events (scheduled, token, finished, step gauges); this class turns them into
observations. ``enabled=False`` makes every event a no-op (the ``--disable-metrics`` baseline of the
overhead benchmark).

OpenTelemetry GenAI names map to Prometheus as the OTel Prometheus exporter maps them: dots become
underscores and the unit ``s`` adds ``_seconds`` (``gen_ai.server.time_to_first_token`` ->
``gen_ai_server_time_to_first_token_seconds``); ``{token}`` adds nothing
(``gen_ai.client.token.usage`` -> ``gen_ai_client_token_usage``, attribute ``gen_ai.token.type`` ->
label ``gen_ai_token_type``). Their buckets are the ones the GenAI semantic conventions advise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from fleetllm.engine.sequence import Sequence
    from fleetllm.kernels.health import KernelStatus

# vLLM's buckets
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
# OpenTelemetry GenAI semantic conventions (explicit bucket boundaries advice)
GENAI_DURATION = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GENAI_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)

IDENTITY_LABELS = ("worker", "role", "zone", "instance_type")


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, mag = [], 1
    while True:
        for m in (1, 2, 5):
            if m * mag > limit:
                return tuple(float(b) for b in out)
            out.append(m * mag)
        mag *= 10


class EngineMetrics:
    def __init__(self, model_name: str, identity: dict[str, str] | None = None, max_model_len: int = 8192,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.registry = CollectorRegistry()
        ident = {k: "" for k in IDENTITY_LABELS} | (identity or {})
        self.labels = {"model_name": model_name, **{k: ident[k] for k in IDENTITY_LABELS}}
        self._define_vllm(max_model_len)
        self._define_genai()
        self._define_spec()
        self._last_queries = self._last_hits = 0

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def _hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, list(self.labels), buckets=buckets, registry=self.registry).labels(**self.labels)

    def _define_vllm(self, max_model_len: int) -> None:
        gauge, counter, hist = self._gauge, self._counter, self._hist
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.step_pauses = counter("fleetllm:step_pauses", "Running steps paused between layers for a more urgent "
                                   "request's prompt (--scheduling-policy priority).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL)
        self.tpot_alias = hist("vllm:time_per_output_token_seconds",
                               "Time between consecutive output tokens (older vLLM name of the ITL).", _ITL)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Per request: decode time / (output tokens - 1).", _ITL)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time from arrival to first schedule.", _E2E)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "First schedule to first token.", _E2E)
        self.decode_time = hist("vllm:request_decode_time_seconds", "First token to finish.", _E2E)
        self.inference_time = hist("vllm:request_inference_time_seconds", "First schedule to finish.", _E2E)
        tok_buckets = buckets_1_2_5(max_model_len)
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", tok_buckets)
        self.req_gen_tokens = hist("vllm:request_generation_tokens", "Generated tokens per request.", tok_buckets)
        self._finished: Counter = Counter("vllm:request_success", "Finished requests by reason.",
                                          [*self.labels, "finished_reason"], registry=self.registry)
        # every reason's series exists from the start, so rates and error panels see it go from 0
        self._finished_by_reason = {reason: self._finished.labels(**self.labels, finished_reason=reason)
                                    for reason in ("stop", "length", "abort", "error")}

    def _define_genai(self) -> None:
        """OpenTelemetry GenAI server metrics (Prometheus form, see the module docstring)."""
        hist = self._hist
        self.genai_ttft = hist("gen_ai_server_time_to_first_token_seconds",
                               "gen_ai.server.time_to_first_token: time to generate the first token.", GENAI_TTFT)
        self.genai_tpot = hist("gen_ai_server_time_per_output_token_seconds",
                               "gen_ai.server.time_per_output_token: per request, after the first token.", GENAI_TPOT)
        self.genai_duration = hist("gen_ai_server_request_duration_seconds",
                                   "gen_ai.server.request.duration: arrival to last token.", GENAI_DURATION)
        usage = Histogram("gen_ai_client_token_usage", "gen_ai.client.token.usage: tokens per request by type.",
                          [*self.labels, "gen_ai_token_type"], buckets=GENAI_TOKENS, registry=self.registry)
        self.genai_input_tokens = usage.labels(**self.labels, gen_ai_token_type="input")
        self.genai_output_tokens = usage.labels(**self.labels, gen_ai_token_type="output")

    def _define_spec(self) -> None:
        self.spec_drafts = self._counter("vllm:spec_decode_num_drafts", "Verify steps that carried draft tokens.")
        self.spec_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position (0-based).",
            [*self.labels, "position"], registry=self.registry,
        )
        self._spec_seen: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        # the same three counts by LoRA adapter (lora_name, vLLM's label; "": the base model)
        self._spec_by_lora = [Counter(name, doc + " By LoRA adapter (lora_name; empty: the base model).",
                                      [*self.labels, "lora_name"], registry=self.registry)
                              for name, doc in (("fleetllm:spec_decode_num_drafts", "Verify steps with drafts."),
                                                ("fleetllm:spec_decode_num_draft_tokens", "Draft tokens proposed."),
                                                ("fleetllm:spec_decode_num_accepted_tokens",
                                                 "Draft tokens accepted."))]
        self._spec_lora_seen: dict[str, list[int]] = {}

    def kernels(self, statuses: list[KernelStatus]) -> None:
        """``fleetllm:kernel_available{kernel, variant}``: 1 per C kernel this CPU should run and runs, 0 for one
        missing (``variant``: the build loaded, else the one this CPU should have)."""
        gauge = Gauge("fleetllm:kernel_available", "1 while the C kernel this CPU should run is loaded from its best "
                      "build; 0 when it is missing (the engine serves through a slower PyTorch path).",
                      [*self.labels, "kernel", "variant"], registry=self.registry)
        for s in statuses:
            if s.expected is not None:
                gauge.labels(**self.labels, kernel=s.kernel, variant=s.variant or s.expected).set(0 if s.missing else 1)

    # ---- events from the engine (monotonic seconds) ------------------------------------------------------
    def scheduled_first(self, seq: Sequence, now: float) -> None:
        if self.enabled:
            self.queue_time.observe(now - seq.arrival_time)

    def paused(self) -> None:
        """A running step paused for a more urgent request (``fleetllm/engine/step_pause.py``)."""
        if self.enabled:
            self.step_pauses.inc()

    def preempted(self, n: int) -> None:
        if self.enabled:
            self.preemptions.inc(n)

    def token(self, seq: Sequence, now: float) -> None:
        """One output token; call before the sequence's token times move to ``now``."""
        if not self.enabled:
            return
        if seq.first_token_time is None:
            # every prompt token counts once, cached or not, as in vLLM (recomputation is not new prompt)
            self.prompt_tokens.inc(len(seq.prompt_token_ids))
            ttft = now - seq.arrival_time
            self.ttft.observe(ttft)
            self.genai_ttft.observe(ttft)
        else:
            itl = now - seq.last_token_time
            self.itl.observe(itl)
            self.tpot_alias.observe(itl)
        self.generation_tokens.inc()

    def finished(self, seq: Sequence, reason: str, now: float) -> None:
        if not self.enabled:
            return
        c = self._finished_by_reason.get(reason)
        if c is None:
            c = self._finished_by_reason[reason] = self._finished.labels(**self.labels, finished_reason=reason)
        c.inc()
        e2e = now - seq.arrival_time
        self.e2e.observe(e2e)
        self.genai_duration.observe(e2e)
        n_out = len(seq.output_token_ids)
        self.req_prompt_tokens.observe(len(seq.prompt_token_ids))
        self.req_gen_tokens.observe(n_out)
        self.genai_input_tokens.observe(len(seq.prompt_token_ids))
        self.genai_output_tokens.observe(n_out)
        if seq.first_scheduled_time is not None:
            self.inference_time.observe(now - seq.first_scheduled_time)
            if seq.first_token_time is not None:
                self.prefill_time.observe(seq.first_token_time - seq.first_scheduled_time)
        if seq.first_token_time is not None:
            self.decode_time.observe(now - seq.first_token_time)
            if n_out > 1:
                tpot = (now - seq.first_token_time) / (n_out - 1)
                self.request_tpot.observe(tpot)
                self.genai_tpot.observe(tpot)

    def step_gauges(self, running: int, waiting: int, kv_usage: float, prefix_queries: int, prefix_hits: int) -> None:
        """Gauges after a step; prefix counters arrive as the cache's running totals."""
        dq, dh = prefix_queries - self._last_queries, prefix_hits - self._last_hits
        self._last_queries, self._last_hits = prefix_queries, prefix_hits  # kept in step while disabled
        if not self.enabled:
            return
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.prefix_queries.inc(dq)
        self.prefix_hits.inc(dh)

    def spec_sync(self, spec: Any) -> None:
        """Bring the speculative decoding counters up to ``spec``'s totals (a SpecDecoder)."""
        drafts, tokens, accepted, per_pos = self._spec_seen
        if self.enabled:
            self.spec_drafts.inc(spec.num_drafts - drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens - tokens)
            self.spec_accepted.inc(spec.num_accepted - accepted)
            for pos, n in enumerate(spec.accepted_per_pos):
                seen = per_pos[pos] if pos < len(per_pos) else 0
                if n > seen:
                    self._spec_per_pos.labels(**self.labels, position=str(pos)).inc(n - seen)
        self._spec_seen = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted, list(spec.accepted_per_pos))
        self._spec_lora_sync(spec.by_lora)

    def _spec_lora_sync(self, by_lora: dict[str, list[int]]) -> None:
        """The per-adapter speculation counters up to ``by_lora``'s totals (``SpecDecoder.by_lora``)."""
        for name, totals in by_lora.items():
            seen = self._spec_lora_seen.setdefault(name, [0, 0, 0])
            if self.enabled:
                for counter, total, was in zip(self._spec_by_lora, totals, seen, strict=True):
                    if total > was:
                        counter.labels(**self.labels, lora_name=name).inc(total - was)
            seen[:] = totals
