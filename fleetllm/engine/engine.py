"""LLMEngine: the synchronous step loop — schedule, run the model, sample, detokenize, check stops.

Not thread-safe; :mod:`fleetllm.engine.async_engine` drives it from one background thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from fleetllm.engine.block_pool import BlockPool
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.detokenizer import IncrementalDetokenizer
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.metrics import EngineMetrics
from fleetllm.engine.model_runner import ModelRunner
from fleetllm.engine.outputs import RequestOutput, RequestTiming, TokenLogprob
from fleetllm.engine.params import PromptTooLong, check_prompt  # noqa: F401  (PromptTooLong: re-exported)
from fleetllm.engine.sampling import InvalidParameter, Sampler, SamplingParams
from fleetllm.engine.scheduler import Scheduler, SchedulerConfig
from fleetllm.engine.sequence import Sequence, Status
from fleetllm.models.loader import LoadedModel, load_model
from fleetllm.models.quant import quantize_model
from fleetllm.speculative.config import SpeculativeConfig
from fleetllm.speculative.decoder import SpecDecoder

logger = logging.getLogger("fleetllm.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = cfg.resolved_device()
        dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        self.loaded = loaded or load_model(cfg.model, device=self.device, dtype=dtype, name=cfg.served_model_name)
        if cfg.quantization != "none" and self.device == "cpu":
            quantize_model(self.loaded.model, cfg.quantization)
        self.model_name = cfg.served_model_name or self.loaded.name
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, 8192)
        num_blocks = cfg.num_blocks or max(
            16, int(cfg.kv_cache_gb * 2**30 // ModelRunner.kv_bytes_per_block(self.loaded.model, cfg.block_size))
        )
        self.kv_events: list[tuple[str, list[int]]] = []
        self.pool = BlockPool(num_blocks, cfg.block_size)
        self.kv = KVCacheManager(self.pool, cfg.enable_prefix_caching, extra_key=self.model_name.encode())
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_waiting), self.kv
        )
        # A sequence must fit the pool on its own (admission keeps the watermark free), or it would wait
        # forever at the head of the queue, or preempt itself forever once running.
        fits = (num_blocks - int(self.scheduler.cfg.watermark * num_blocks)) * cfg.block_size
        self.max_model_len = min(self.max_model_len, fits)
        self.runner = ModelRunner(self.loaded.model, num_blocks, cfg.block_size, self.device)
        self.sampler = Sampler()
        spec_cfg = SpeculativeConfig.parse(cfg.speculative)
        self.spec = SpecDecoder(spec_cfg, self.loaded, self.runner.kv_cache, self.device) if spec_cfg else None
        self.metrics = EngineMetrics(self.model_name, cfg.metric_labels, self.max_model_len, not cfg.disable_metrics)
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._eos = set(mcfg.eos_token_ids)

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises PromptTooLong / InvalidParameter / QueueFull (nothing is queued then)."""
        if request_id in self.seqs:
            raise InvalidParameter("request_id", f"duplicate request id {request_id!r}")
        max_tokens = check_prompt(prompt_token_ids, params, self.max_model_len, self.loaded.config.vocab_size)
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        seq = Sequence(request_id, list(prompt_token_ids), params, max_tokens, generator=gen)
        if arrival_time is not None:  # when the server received it: queueing before this call counts
            seq.arrival_time = arrival_time
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        self.detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; a final output with reason 'abort' follows."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status.finished:
            return
        self.scheduler.finish(seq, Status.FINISHED_ABORTED)
        self._pending.append(self._finish_output(seq, [], None))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.preempted:
            self.metrics.preempted(len(sched.preempted))
        now = time.monotonic()
        if not sched.scheduled:
            self._update_gauges()
            return outputs
        batch = sched.scheduled
        logit_rows: list[int] = []
        t = 0
        for s in batch:
            t += s.num_new_tokens
            logit_rows.extend(range(t - s.num_logits, t))
        sample_rows = [i for i, s in enumerate(batch) if s.num_logits and not s.draft_token_ids]
        for s in batch:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
                self.metrics.scheduled_first(s.seq, now)
        try:
            aux_layers = self.spec.aux_layers if self.spec else None
            t0 = time.perf_counter()
            logits, aux = self.runner.execute(batch, logit_rows, aux_layers)
            logits = logits.float().cpu()  # sampling runs on the host
            if self.spec and any(s.draft_token_ids for s in batch):
                self.spec.verify_seconds += time.perf_counter() - t0
            plain = {i: j for j, i in enumerate(sample_rows)}
            row_of, r = {}, 0
            for i, s in enumerate(batch):
                row_of[i], r = r, r + s.num_logits
            seqs = [batch[i].seq for i in sample_rows]
            result = None if not seqs else self.sampler(
                logits[[row_of[i] for i in sample_rows]],
                [q.params for q in seqs],
                [q.generator for q in seqs],
                [q.prompt_token_ids for q in seqs],
                [q.output_token_ids for q in seqs],
            )
            emitted: dict[int, list[int]] = {}
            for i, s in enumerate(batch):
                if s.draft_token_ids:
                    rows = logits[row_of[i] : row_of[i] + s.num_logits]
                    emitted[i] = self.spec.verify(s.seq, rows, s.draft_token_ids)
                elif i in plain:
                    emitted[i] = [result.token_ids[plain[i]]]
        except Exception as e:  # a failed step fails its requests, never the engine
            for s in batch:
                self.scheduler.finish(s.seq, Status.FINISHED_ERROR)
                outputs.append(self._finish_output(s.seq, [], None, error=f"{type(e).__name__}: {e}"))
            return outputs

        now = time.monotonic()
        t = 0
        for i, s in enumerate(batch):
            seq, start = s.seq, t
            t += s.num_new_tokens
            toks = emitted.get(i)
            # Only the last sampled token and the accepted drafts become computed: the KV slots of
            # rejected drafts hold garbage that the next step overwrites, and no block holding one is
            # ever registered in the prefix cache.
            computed = s.num_new_tokens if not s.draft_token_ids else len(toks)
            if aux is not None:
                self.spec.drafter.observe(seq, seq.num_computed_tokens, aux[start : start + computed])
            seq.num_computed_tokens += computed
            if not s.draft_token_ids:  # every computed token is already in the sequence: cache now
                self.kv.cache_full_blocks(seq)
            if toks is None:
                continue
            lps = None
            if seq.params.logprobs is not None:
                if s.draft_token_ids:
                    lps = self._logprobs(logits[row_of[i] : row_of[i] + len(toks)], toks, seq.params.logprobs)
                else:
                    j = plain[i]
                    lps = [TokenLogprob(toks[0], result.logprobs[j], result.top_logprobs[j])]
            out = self._append_tokens(seq, toks, lps, now)
            if s.draft_token_ids and not out.finished:  # accepted drafts are in the sequence only now
                self.kv.cache_full_blocks(seq)
            outputs.append(out)
        if self.spec:
            decoding = [q for q in self.scheduler.running if q.num_uncomputed == 1]
            try:
                self.spec.propose(decoding, self.max_model_len)
            except Exception:  # a failing drafter costs speculation for one step, never a request
                logger.exception("drafter failed; this step runs without drafts")
                for q in decoding:
                    q.draft_token_ids = []
        self._update_gauges()
        return outputs

    @staticmethod
    def _logprobs(logits: torch.Tensor, toks: list[int], k: int) -> list[TokenLogprob]:
        lp = torch.log_softmax(logits, dim=-1)
        out = []
        for r, tok in enumerate(toks):
            top = []
            if k > 0:
                vals, idx = lp[r].topk(k)
                top = list(zip(idx.tolist(), vals.tolist(), strict=True))
            out.append(TokenLogprob(tok, float(lp[r, tok]), top))
        return out

    def _append_tokens(self, seq: Sequence, toks: list[int], lps: list[TokenLogprob] | None, now: float) -> RequestOutput:
        """Append tokens in order, stopping at the first that finishes the request (the rest are dropped)."""
        text, new = "", []
        for n, tok in enumerate(toks):
            new.append(tok)
            out = self._append_token(seq, tok, lps[n : n + 1] if lps else None, now)
            if out.finished:
                return replace(out, new_token_ids=new, new_text=text + out.new_text, logprobs=lps[: n + 1] if lps else None)
            text += out.new_text
        return replace(out, new_token_ids=new, new_text=text, logprobs=lps)

    def _append_token(self, seq: Sequence, tok: int, lp: list[TokenLogprob] | None, now: float) -> RequestOutput:
        self.metrics.token(seq, now)
        seq.append_output(tok, now)
        detok = self.detok[seq.request_id]
        status = seq.stop_status(tok, detok.push(tok), self._eos, self.max_model_len)
        if status is None:
            return RequestOutput(
                seq.request_id, [tok], detok.release(False), False, len(seq.prompt_token_ids),
                len(seq.output_token_ids), seq.num_cached_tokens, logprobs=lp,
            )
        self.scheduler.finish(seq, status)
        return self._finish_output(seq, [tok], lp)

    def _finish_output(self, seq: Sequence, new: list[int], lp: list[TokenLogprob] | None, error: str | None = None) -> RequestOutput:
        detok = self.detok.pop(seq.request_id)
        del self.seqs[seq.request_id]
        if self.spec:
            self.spec.drafter.forget(seq)
        reason = seq.status.value
        now = time.monotonic()
        self.metrics.finished(seq, reason, now)
        timing = RequestTiming(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, now)
        return RequestOutput(
            seq.request_id, new, detok.release(True), True, len(seq.prompt_token_ids), len(seq.output_token_ids),
            max(seq.num_cached_tokens, 0), reason, seq.stop_reason, lp, error, timing,
        )

    def _update_gauges(self) -> None:
        self.metrics.step_gauges(len(self.scheduler.running), len(self.scheduler.waiting), self.pool.usage,
                                 self.kv.prefix_queries, self.kv.prefix_hits)
        if self.spec:
            self.metrics.spec_sync(self.spec)

    def warm_up(self, prompt_len: int = 8, max_tokens: int = 2) -> float:
        """Run one short request to completion with metrics muted (first-call costs: allocator, kernels,
        thread pools); return its seconds. The prompt is shorter than a block, so nothing stays cached."""
        t0 = time.perf_counter()
        enabled, self.metrics.enabled = self.metrics.enabled, False
        try:
            n = max(1, min(prompt_len, self.config.block_size - 1, self.max_model_len - max_tokens - 1))
            self.add_request("warm-up", [1] * n, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            while self.has_unfinished():
                self.step()
        finally:
            self.metrics.enabled = enabled
        return time.perf_counter() - t0
