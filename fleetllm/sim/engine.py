"""SimEngine: the engine's scheduler, block pool and prefix cache, with a timing model for the model.

It has the interface the worker and :class:`fleetllm.engine.async_engine.AsyncEngine` use of
:class:`fleetllm.engine.engine.LLMEngine` (``add_request``, ``abort_request``, ``step``, ``pool``,
``scheduler``, ``metrics``, ``tokenizer``), so the same HTTP server, KV events and metrics run over
it. A step schedules exactly as the real engine does, then sleeps for the time the profile predicts
for that batch (decode sequences, prefill tokens, context) and emits one synthetic token per
sampling sequence. Output text is a fixed cycle of ordinary words (its content is not the point),
``max_tokens`` and stop strings are honoured, EOS is never produced.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from fleetllm.engine.block_pool import BlockPool
from fleetllm.engine.detokenizer import IncrementalDetokenizer
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.metrics import EngineMetrics
from fleetllm.engine.outputs import RequestOutput, RequestTiming
from fleetllm.engine.params import InvalidParameter, SamplingParams, check_prompt
from fleetllm.engine.scheduler import Scheduler, SchedulerConfig
from fleetllm.engine.sequence import Sequence, Status
from fleetllm.models.config import ModelConfig
from fleetllm.models.tokenizer import TokenizerWrapper
from fleetllm.sim.config import SimConfig
from fleetllm.sim.profile import TimingProfile

_TEXT = ("The fleet routes each request to the replica that already holds its prefix, so the prompt "
         "is not computed twice and the answer starts sooner. ")


class SimEngine:
    def __init__(self, cfg: SimConfig, tokenizer: TokenizerWrapper, model_config: ModelConfig,
                 profile: TimingProfile | None = None, identity: dict[str, str] | None = None) -> None:
        self.config = cfg
        self.profile = profile or TimingProfile.default()
        self.model_name = cfg.model_name
        self.tokenizer = tokenizer
        self.loaded = SimpleNamespace(config=model_config, load_seconds=0.0)
        self.max_model_len = min(cfg.max_model_len, model_config.max_position_embeddings)
        bs = cfg.block_size or self.profile.block_size
        self.pool = BlockPool(cfg.num_blocks or self.profile.num_blocks, bs)
        self.kv = KVCacheManager(self.pool, cfg.enable_prefix_caching, extra_key=self.model_name.encode())
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_waiting), self.kv)
        self.max_model_len = min(self.max_model_len, int(self.pool.num_blocks * (1 - self.scheduler.cfg.watermark)) * bs)
        self.device = "cpu"
        self.metrics = EngineMetrics(self.model_name, identity, self.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []
        self._text_ids = tokenizer.encode(_TEXT * 4, add_special_tokens=False)
        self.simulated_seconds = 0.0

    # ---- requests (same contract as LLMEngine) ------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.seqs:
            raise InvalidParameter("request_id", f"duplicate request id {request_id!r}")
        max_tokens = check_prompt(prompt_token_ids, params, self.max_model_len, self.loaded.config.vocab_size,
                                  self.config.default_max_tokens)
        seq = Sequence(request_id, list(prompt_token_ids), params, max_tokens)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        self.detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                                        params.skip_special_tokens)

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is None or seq.status.finished:
            return
        self.scheduler.finish(seq, Status.FINISHED_ABORTED)
        self._pending.append(self._finish(seq, []))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.preempted:
            self.metrics.preempted(len(sched.preempted))
        batch = sched.scheduled
        if not batch:
            self._update_gauges()
            return outputs
        decode = [s for s in batch if s.seq.output_token_ids and s.num_new_tokens == 1]
        prefill_tokens = sum(s.num_new_tokens for s in batch) - len(decode)
        context = sum(s.seq.num_computed_tokens for s in decode)
        dt = self.profile.step_seconds(len(decode), prefill_tokens, context) / self.config.speed
        self.simulated_seconds += dt
        for s in batch:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = t0
                self.metrics.scheduled_first(s.seq, t0)
        remaining = dt - (time.monotonic() - t0)
        if remaining > 0:
            time.sleep(remaining)
        now = time.monotonic()
        for s in batch:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                outputs.append(self._append(seq, self._next_token(seq), now))
        self._update_gauges()
        return outputs

    def _next_token(self, seq: Sequence) -> int:
        return self._text_ids[(len(seq.prompt_token_ids) + len(seq.output_token_ids)) % len(self._text_ids)]

    def _append(self, seq: Sequence, tok: int, now: float) -> RequestOutput:
        self.metrics.token(seq, now)
        seq.append_output(tok, now)
        detok = self.detok[seq.request_id]
        status = seq.stop_status(tok, detok.push(tok), frozenset(), self.max_model_len)  # synthetic text: no EOS
        if status is None:
            return RequestOutput(seq.request_id, [tok], detok.release(False), False, len(seq.prompt_token_ids),
                                 len(seq.output_token_ids), seq.num_cached_tokens)
        self.scheduler.finish(seq, status)
        return self._finish(seq, [tok])

    def _finish(self, seq: Sequence, new: list[int]) -> RequestOutput:
        detok = self.detok.pop(seq.request_id)
        del self.seqs[seq.request_id]
        now = time.monotonic()
        self.metrics.finished(seq, seq.status.value, now)
        timing = RequestTiming(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, now)
        return RequestOutput(seq.request_id, new, detok.release(True), True, len(seq.prompt_token_ids),
                             len(seq.output_token_ids), max(seq.num_cached_tokens, 0), seq.status.value, seq.stop_reason,
                             timing=timing)

    def _update_gauges(self) -> None:
        self.metrics.step_gauges(len(self.scheduler.running), len(self.scheduler.waiting), self.pool.usage,
                                 self.kv.prefix_queries, self.kv.prefix_hits)

    def warm_up(self) -> float:
        return 0.0  # nothing to warm: no weights, no kernels
