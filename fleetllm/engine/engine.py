"""LLMEngine: the synchronous step loop — schedule, execute, update from the output, draft.

The model work sits behind an :class:`fleetllm.engine.executor.Executor`: the real one
(:class:`fleetllm.engine.model_executor.ModelExecutor`, built by default) or the simulated worker's
timing model. What a step leaves behind (computed counts, prefix caching, appends, stop checks,
finishing, metrics) happens here, once, whichever executor ran it. Draft tokens travel as data: the
executor proposes them after a step, the next ``schedule`` takes them.

Not thread-safe; :mod:`fleetllm.engine.async_engine` drives it from one background thread. Torch-free
itself: only the real executor loads PyTorch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, TypeVar

from fleetllm.engine.block_pool import BlockPool
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.detokenizer import IncrementalDetokenizer
from fleetllm.engine.executor import Executor, ModelOutput, Sampled
from fleetllm.engine.expert_metrics import ExpertLoadMetrics
from fleetllm.engine.handoff import Handoff, sampler_state
from fleetllm.engine.kv_cache_manager import KVCacheManager
from fleetllm.engine.kv_connector.access import BlockAccess
from fleetllm.engine.metrics import EngineMetrics
from fleetllm.engine.outputs import RequestOutput, RequestTiming, TokenLogprob
from fleetllm.engine.params import InvalidParameter, PromptTooLong, SamplingParams, check_params, check_prompt
from fleetllm.engine.scheduler import Scheduled, Scheduler, SchedulerConfig, SchedulerOutput
from fleetllm.engine.sequence import Sequence, Status
from fleetllm.engine.step_pause import StepPause, step_guard
from fleetllm.engine.step_profile import StepProfile, phase

if TYPE_CHECKING:
    import torch

    from fleetllm.engine.kv_connector.base import KVConnector
    from fleetllm.engine.kv_memory import SharedKVFile
    from fleetllm.kernels.health import KernelStatus
    from fleetllm.lora.registry import LoraManager
    from fleetllm.models.loader import LoadedModel
    from fleetllm.speculative.decoder import SpecDecoder
    from fleetllm.structured.compiler import GrammarCompiler

C = TypeVar("C")

__all__ = ["EngineConfig", "LLMEngine", "PromptTooLong", "RequestOutput", "TokenLogprob"]

logger = logging.getLogger("fleetllm.engine")


class LLMEngine:
    """Requests in, per-step output deltas out, over a scheduler, a block pool and an executor."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 executor: Executor | None = None, default_max_tokens: int | None = None) -> None:
        """Without ``executor``, run the model itself (``loaded`` reuses weights already in memory).
        ``default_max_tokens`` caps a request that gives no ``max_tokens`` (None: the context's room)."""
        self.config = cfg = config or EngineConfig()
        if executor is None:
            from fleetllm.engine.model_executor import ModelExecutor  # PyTorch: only the real engine needs it

            executor = ModelExecutor(cfg, loaded)
        self.executor = executor
        self.loaded = executor.loaded
        self.device = executor.device
        self.model_name = cfg.served_model_name or self.loaded.name
        self.tokenizer = self.loaded.tokenizer
        self.default_max_tokens = default_max_tokens
        self.pool = BlockPool(executor.num_blocks, cfg.block_size)
        self.kv = KVCacheManager(self.pool, cfg.enable_prefix_caching, model=self.model_name)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_waiting,
                            policy=cfg.scheduling_policy, priority_aging_s=cfg.priority_aging_s,
                            urgent_step_rows=cfg.urgent_step_rows), self.kv
        )
        self.lora: LoraManager | None = None  # the adapters (--enable-lora), their slots in the step's tables
        if cfg.enable_lora:
            from fleetllm.lora.engine_side import lora_manager

            self.lora = self.scheduler.lora = lora_manager(cfg, executor, self.model_name)
        mcfg = self.loaded.config
        # A sequence must fit the pool on its own (admission keeps the watermark free), or it would wait
        # forever at the head of the queue, or preempt itself forever once running.
        fits = (self.pool.num_blocks - self.scheduler.watermark_blocks) * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or 8192, mcfg.max_position_embeddings, fits)
        self.metrics = EngineMetrics(self.model_name, cfg.metric_labels, self.max_model_len, not cfg.disable_metrics)
        self.expert_load = ExpertLoadMetrics.of(getattr(self.loaded, "model", None), self.metrics, cfg.moe_expert_metrics)
        self.kernels: list[KernelStatus] = getattr(executor, "kernels", [])  # a simulated executor runs none
        self.metrics.kernels(self.kernels)
        self.seqs: dict[str, Sequence] = {}
        self.blocks = BlockAccess(self)  # what a KV connector reaches of this engine
        self.kv_connector: KVConnector | None = None  # KV entering and leaving the pool (set_kv_connector)
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._drafts: dict[str, list[int]] = {}  # proposed after the last step, verified in the next
        self._eos = set(mcfg.eos_token_ids)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # two requests' threads may ask for it first at once
        # --profile-steps: the executor's profile when it keeps one (it times its own phases), else the engine's
        self.profile: StepProfile | None = getattr(executor, "step_profile", None) or (
            StepProfile() if cfg.profile_steps else None)
        # a running step paused between layers for a more urgent arrival (under priority scheduling, see
        # step_pause.py); a profile's phases would hold the urgent step inside the paused one's forward: none then
        pausing = cfg.scheduling_policy == "priority" and cfg.step_pause and self.profile is None
        self.step_pause: StepPause | None = getattr(executor, "step_pause", None) if pausing else None

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer (built on first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                from fleetllm.structured.compiler import GrammarCompiler

                eos = self.tokenizer.eos_token_id
                self._grammars = GrammarCompiler(self.tokenizer, eos if eos is not None else min(self._eos))
            return self._grammars

    @property
    def spec(self) -> SpecDecoder | None:
        """The speculative decoder (acceptance counters), or None without speculation."""
        return self.executor.spec

    def kv_blocks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``[num_blocks, block_size, kv_heads, head_dim]`` views of the K and V cache."""
        caches = self.executor.kv_caches()
        if caches is None:
            raise RuntimeError("this executor holds no KV tensors")
        return caches.layers

    def kv_pool_file(self) -> SharedKVFile | None:
        """The shared-memory file the KV cache lives in, for other workers on this host to map (None: private
        memory, or no KV tensors)."""
        caches = self.executor.kv_caches()
        return None if caches is None else caches.pool_file

    def set_kv_connector(self, connector: KVConnector | None) -> None:
        """Attach the KV connector (:mod:`fleetllm.engine.kv_connector`): its scheduler side planned into every
        step, its worker side driven by the executor, this engine's blocks reached through :attr:`blocks`.
        Call between steps."""
        self.kv_connector = connector
        self.scheduler.connector = connector
        if connector is not None:
            connector.bind(self.blocks)
        self.executor.register_kv_connector(connector)

    def add_kv_connector(self, connector: KVConnector) -> None:
        """Attach one more KV connector beside those attached (:mod:`fleetllm.engine.kv_connector.multi`)."""
        from fleetllm.engine.kv_connector.multi import MultiConnector

        have = self.kv_connector
        if have is None:
            return self.set_kv_connector(connector)
        both = [*have.connectors, connector] if isinstance(have, MultiConnector) else [have, connector]
        self.set_kv_connector(MultiConnector(both))

    def kv_connector_of(self, kind: type[C]) -> C | None:
        """The attached KV connector of class ``kind`` (None: none)."""
        from fleetllm.engine.kv_connector.multi import MultiConnector

        have = self.kv_connector
        for c in have.connectors if isinstance(have, MultiConnector) else [have]:
            if isinstance(c, kind):
                return c
        return None

    def prompt_pending(self, request_id: str) -> bool:
        """Whether request ``request_id`` is here with part of its prompt still to compute: a connector told of
        it now (between steps) sees the step that completes that prompt."""
        seq = self.seqs.get(request_id)
        return seq is not None and seq.num_computed_tokens < len(seq.prompt_token_ids)

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, handoff: Handoff | None = None,
                    lora_name: str | None = None) -> None:
        """Queue a request. Raises PromptTooLong / InvalidParameter / QueueFull, or :class:`LoraError` (404) for
        a ``lora_name`` that names no loaded adapter (nothing is queued then).

        With ``handoff`` (its prompt prefilled elsewhere, :mod:`fleetllm.engine.handoff`) it runs at once from
        the handed-over KV and first token, whose output :meth:`take_outputs` returns; a handoff that does not
        fit the prompt, or finds no free sequence slot, is let go (its blocks freed) and the request queued.
        ``lora_name``: the adapter it runs with (None: the base model)."""
        if lora_name is not None:
            self._check_lora(lora_name)
        if handoff is not None and not (handoff.fits(prompt_token_ids, self.pool.block_size, lora_name)
                                        and self.scheduler.has_room()
                                        and (lora_name is None or self.lora.can_acquire(lora_name))):
            self.pool.release(handoff.blocks)
            handoff = None
        try:
            seq = self._new_sequence(request_id, prompt_token_ids, params, arrival_time)
            seq.lora_name = lora_name
            if handoff is None:
                self.scheduler.add(seq)
            elif lora_name is not None:  # running at once: its adapter's slot pinned now
                seq.lora_slot = self.lora.acquire(lora_name)
        except BaseException:
            if handoff is not None:
                self.pool.release(handoff.blocks)
            raise
        self.seqs[request_id] = seq
        self.detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        if handoff is not None:
            self._take_over(seq, handoff)

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      arrival_time: float | None) -> Sequence:
        if request_id in self.seqs:
            raise InvalidParameter("request_id", f"duplicate request id {request_id!r}")
        max_tokens = check_prompt(prompt_token_ids, params, self.max_model_len, self.loaded.config.vocab_size,
                                  self.default_max_tokens)
        seq = Sequence(request_id, list(prompt_token_ids), params, max_tokens)
        if params.structured is not None:
            seq.grammar = self._grammar_state(params)
        if arrival_time is not None:  # when the server received it: queueing before this call counts
            seq.arrival_time = arrival_time
        return seq

    def _take_over(self, seq: Sequence, h: Handoff) -> None:
        """Run ``seq`` from a handed-over prefill: its blocks, its prompt computed, its first token appended
        and output as if this engine's last prefill chunk had sampled it."""
        seq.block_table, seq.block_hashes = list(h.blocks), list(h.hashes)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.prompt_token_ids)
        seq.sampler_state = h.sampler_state
        self.scheduler.add_running(seq)
        now = time.monotonic()
        seq.first_scheduled_time = now
        self.metrics.scheduled_first(seq, now)
        sampled = Sampled([h.first_token], None if h.logprob is None else [h.logprob])
        status, n = self._append_tokens(seq, sampled, now)
        self._pending.append(self._step_output(seq, sampled, status, n))

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs made between steps (aborts, handed-over first tokens), now rather than after the next step."""
        outputs, self._pending = self._pending, []
        if outputs:  # requests started or ended without a step: the gauges a step would set
            self._update_gauges()
        return outputs

    def _grammar_state(self, params: SamplingParams) -> object:
        from fleetllm.structured.compiler import InvalidGrammar

        try:
            return self.grammars.state(params.structured)
        except InvalidGrammar as e:
            raise InvalidParameter("response_format", f"invalid {params.structured.kind} constraint: {e}") from None

    # ---- adapters (--enable-lora) -------------------------------------------------------------------
    def _check_lora(self, name: str) -> None:
        from fleetllm.lora.errors import LoraError

        if self.lora is None:
            raise LoraError(f"the adapter `{name}` does not exist: this engine serves no adapters (--enable-lora)",
                            status=404)
        self.lora.slot_for(name)  # raises the 404 for a name not loaded

    def load_lora(self, name: str, path: str, adapter: object | None = None) -> None:
        """Load the PEFT adapter at ``path`` as ``name`` (``adapter``: already read by ``self.lora.read(path)``,
        e.g. off the engine thread). Raises :class:`fleetllm.lora.errors.LoraError`; nothing changes then."""
        from fleetllm.lora.errors import LoraError

        if self.lora is None:
            raise LoraError("adapters are not enabled on this engine (--enable-lora)")
        self.lora.load(name, path, adapter)

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (404 when unknown): new requests for it are refused, running ones finish, and its
        cached prefixes are forgotten (a later adapter of the same name may differ)."""
        self._check_lora(name)
        self.lora.unload(name)
        self.pool.forget_adapter(name)

    def lora_names(self) -> list[str]:
        """The loaded adapters' names (empty without --enable-lora)."""
        return [] if self.lora is None else self.lora.names()

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
        """Schedule, execute, update from the output, draft for the next step; return this step's outputs."""
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        drafts, self._drafts = self._drafts, {}
        prof = self.profile
        with phase(prof, "schedule"):
            sched = self.scheduler.schedule(drafts)
            self._note_scheduled(sched)
        outputs += [self._finish_output(seq, [], None, error=why) for seq, why in sched.failed]
        if sched.scheduled:
            self._arm_pause(sched)
            result, failed = self._execute(sched)
            outputs += failed
            if result is not None:
                with phase(prof, "update"):
                    outputs += self.update_from_output(sched, result)
                with phase(prof, "propose"):
                    self._drafts = self._propose()
        self._update_gauges()
        if self.expert_load is not None:
            self.expert_load.observe()
        if prof is not None:
            prof.step_done(time.perf_counter() - t0, sum(len(o.new_token_ids) for o in outputs))
        return outputs

    def urgent_step(self) -> list[RequestOutput]:
        """While a step is paused between layers (:mod:`fleetllm.engine.step_pause`, on the engine thread): compute in
        a step of its own the prompts of the waiting requests more urgent than the paused step's guard (none
        preempted: the paused step's rows keep their blocks), and return its outputs (the urgent first tokens)."""
        guard = self.step_pause.guard if self.step_pause is not None else None
        if guard is None:
            return []
        self.metrics.paused()
        sched = self.scheduler.schedule_urgent(guard)
        self._note_scheduled(sched)
        outputs = [self._finish_output(seq, [], None, error=why) for seq, why in sched.failed]
        if sched.scheduled:
            result, failed = self._execute(sched)
            outputs += failed
            if result is not None:
                outputs += self.update_from_output(sched, result)
        return outputs

    def _arm_pause(self, sched: SchedulerOutput) -> None:
        """Let arrivals more urgent than ``sched``'s rows pause it. Only the C stack pauses, and a step with a KV
        connector's per-layer work (a P/D prefill streaming its layers) runs op by op: the connector's per-step
        state never sees another step start inside one of its own."""
        if self.step_pause is None:
            return
        rows = [(s.seq.params.priority, not s.seq.output_token_ids) for s in sched.scheduled]
        self.step_pause.arm(step_guard(rows))

    def _execute(self, sched: SchedulerOutput) -> tuple[ModelOutput | None, list[RequestOutput]]:
        """The step's model output, and the outputs of the requests it failed.

        A step that raises fails only the requests :meth:`_blame` finds at fault (parameters a check refuses,
        which could only have reached the step by bypassing the edge's checks) and runs again without them
        (``sched`` loses them); one that raises with nobody to blame, or again, fails every request it held —
        never the engine."""
        try:
            if self.kv_connector is not None:  # built once: a step run again keeps what the connector planned
                sched.kv_connector_metadata = self.kv_connector.build_connector_meta(sched)
            return self.executor.execute(sched), []
        except Exception as e:
            blamed = self._blame(sched)
            if not blamed:
                logger.exception("a step failed with no request to blame; failing its %d", len(sched.scheduled))
                return None, self._fail(sched.scheduled, f"{type(e).__name__}: {e}")
        logger.warning("a step failed on the parameters of %d request(s); running it again without them", len(blamed))
        failed = self._fail([s for s in sched.scheduled if s.seq.request_id in blamed], blamed)
        sched.scheduled = [s for s in sched.scheduled if s.seq.request_id not in blamed]
        if not sched.scheduled:
            return None, failed
        try:
            return self.executor.execute(sched), failed
        except Exception as e:
            logger.exception("the step failed again without the blamed requests; failing its %d", len(sched.scheduled))
            return None, failed + self._fail(sched.scheduled, f"{type(e).__name__}: {e}")

    def _blame(self, sched: SchedulerOutput) -> dict[str, str]:
        """The scheduled requests whose parameters the per-request check refuses, each with why."""
        blamed = {}
        for s in sched.scheduled:
            try:
                check_params(s.seq.params, self.loaded.config.vocab_size)
            except Exception as e:  # noqa: BLE001 - a check that cannot even run on them blames them too
                blamed[s.seq.request_id] = f"{type(e).__name__}: {e}"
        return blamed

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        if sched.preempted or sched.displaced:
            self.metrics.preempted(len(sched.preempted) + len(sched.displaced))
        now = time.monotonic()
        for s in sched.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
                self.metrics.scheduled_first(s.seq, now)

    def update_from_output(self, sched: SchedulerOutput, result: ModelOutput) -> list[RequestOutput]:
        """Everything a step leaves behind: each request's new tokens (up to a stop), its computed count,
        its newly full blocks in the prefix cache, and its output (final, with its blocks freed, when it stops)."""
        now = time.monotonic()
        outputs = []
        for s in sched.scheduled:
            seq = s.seq
            sampled = result.sampled.get(seq.request_id)
            status, n = self._append_tokens(seq, sampled, now) if sampled else (None, 0)
            emitted = sampled.token_ids if sampled else []
            # Rejected drafts are not computed: their KV slots hold garbage the next step overwrites. A stop
            # inside accepted drafts leaves computed positions past the end, hence the cap.
            seq.num_computed_tokens = min(seq.num_computed_tokens + s.num_computed(emitted), seq.num_tokens)
            gone = seq.lora_name is not None and not self.lora.has(seq.lora_name)  # unloaded: cache nothing more
            if not gone and (self.kv_connector is None or self.kv_connector.caches_locally(seq)):
                self.kv.cache_full_blocks(seq)
            if sampled is not None:
                outputs.append(self._step_output(seq, sampled, status, n))
        return outputs

    def _step_output(self, seq: Sequence, sampled: Sampled, status: Status | None, n: int) -> RequestOutput:
        """The output of the ``n`` tokens just appended to ``seq``; with ``status``, it finishes (blocks freed)."""
        emitted = sampled.token_ids[:n]
        lps = sampled.logprobs[:n] if sampled.logprobs else None
        if status is None:
            return RequestOutput(seq.request_id, emitted, self.detok[seq.request_id].release(False), False,
                                 len(seq.prompt_token_ids), len(seq.output_token_ids), seq.num_cached_tokens,
                                 logprobs=lps)
        self.scheduler.finish(seq, status)
        return self._finish_output(seq, emitted, lps)

    def _append_tokens(self, seq: Sequence, sampled: Sampled, now: float) -> tuple[Status | None, int]:
        """Append the tokens in order up to the first that finishes the request (the rest are dropped);
        return the finished status (None: still running) and how many were appended."""
        detok = self.detok[seq.request_id]
        for n, tok in enumerate(sampled.token_ids, 1):
            self.metrics.token(seq, now)
            seq.append_output(tok, now)
            status = seq.stop_status(tok, detok.push(tok), self._eos, self.max_model_len)
            if status is None and seq.grammar is not None and (not seq.grammar.accept(tok) or seq.grammar.finished):
                # masks keep sampled tokens valid; a token the grammar refuses (an executor that ignores
                # masks) or a complete grammar ends the output here
                status = Status.FINISHED_STOPPED
            if status is not None:
                return status, n
        return None, len(sampled.token_ids)

    def _propose(self) -> dict[str, list[int]]:
        decoding = [q for q in self.scheduler.running if q.num_uncomputed == 1]
        try:
            drafts = self.executor.propose(decoding, self.max_model_len)
        except Exception:  # a failing drafter costs speculation for one step, never a request
            logger.exception("drafter failed; this step runs without drafts")
            drafts = {}
        drafts = {rid: d for rid, d in map(self._grammar_valid, drafts.items()) if d}
        most = self.spec.max_k if self.spec else None  # a speculative decoder counts acceptance per position
        for seq in decoding:
            forced = seq.grammar.forced_tokens() if seq.grammar is not None else []
            room = min(seq.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
            room = room if most is None else min(room, most)
            if forced and room > 0:
                # Tokens the grammar forces (a call's fixed keys, a schema's property names) are drafts that
                # verify checks like any other: taken when the model agrees, so output is unchanged (greedy
                # identical), in one step instead of one each.
                drafts[seq.request_id] = forced[:room]
        return drafts

    def _grammar_valid(self, item: tuple[str, list[int]]) -> tuple[str, list[int]]:
        """A structured request's drafts cut at the first its grammar forbids: a forbidden draft can never
        be accepted (its masked probability is 0), and the masks of the rows after it would be undefined."""
        rid, drafts = item
        grammar = self.seqs[rid].grammar
        return rid, drafts if grammar is None else drafts[: grammar.valid_prefix(drafts)]

    def _fail(self, scheduled: list[Scheduled], error: str | dict[str, str]) -> list[RequestOutput]:
        """Finish ``scheduled``'s requests with ``error`` (one for all, or by request id)."""
        outputs = []
        for s in scheduled:
            self.scheduler.finish(s.seq, Status.FINISHED_ERROR)
            why = error if isinstance(error, str) else error[s.seq.request_id]
            outputs.append(self._finish_output(s.seq, [], None, error=why))
        return outputs

    def _finish_output(self, seq: Sequence, new: list[int], lp: list[TokenLogprob] | None, error: str | None = None) -> RequestOutput:
        detok = self.detok.pop(seq.request_id)
        del self.seqs[seq.request_id]
        self.executor.forget(seq)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(seq)
        reason = seq.status.value
        now = time.monotonic()
        self.metrics.finished(seq, reason, now)
        timing = RequestTiming(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, now)
        return RequestOutput(
            seq.request_id, new, detok.release(True), True, len(seq.prompt_token_ids), len(seq.output_token_ids),
            max(seq.num_cached_tokens, 0), reason, seq.stop_reason, lp, error, timing, sampler_state(seq),
        )

    def _update_gauges(self) -> None:
        self.metrics.step_gauges(len(self.scheduler.running), len(self.scheduler.waiting), self.pool.usage,
                                 self.kv.prefix_queries, self.kv.prefix_hits)
        if self.executor.spec:
            self.metrics.spec_sync(self.executor.spec)

    def warm_up(self, prompt_len: int = 8, max_tokens: int = 2) -> float:
        """Run one short request to completion with metrics muted (first-call costs: allocator, kernels,
        thread pools); return its seconds. The prompt is shorter than a block, so nothing stays cached.
        An executor without such costs (the timing model) skips it."""
        if not self.executor.needs_warm_up:
            return 0.0
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
