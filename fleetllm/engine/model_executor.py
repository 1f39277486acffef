"""The real executor: the model runner's forward pass, the sampler, and speculative verify and drafting.

One forward pass computes every scheduled token; logits are taken at each request's sampling rows (the
last one, or 1 + K rows when it verifies K drafts). Plain rows go through the batched sampler, verify
rows through the lossless acceptance rule; a drafter that reads the target's hidden states gets them
for the positions that stay computed. It owns the weights, the KV cache tensors and the per-request
sampling state; the engine owns everything the step leaves behind.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from fleetllm.engine.executor import ModelOutput, Sampled
from fleetllm.engine.kv_connector.base import KVCaches, KVConnectorWorker
from fleetllm.engine.kv_memory import shm_dir
from fleetllm.engine.model_runner import ModelRunner, kv_dtype_of
from fleetllm.engine.outputs import TokenLogprob
from fleetllm.engine.sampling import Sampler
from fleetllm.engine.scheduler import Scheduled, SchedulerConfig, SchedulerOutput
from fleetllm.engine.sequence import Sequence
from fleetllm.engine.step_pause import StepPause
from fleetllm.engine.step_profile import StepProfile, phase
from fleetllm.errors import UsageError
from fleetllm.kernels import health
from fleetllm.models.loader import LoadedModel, load_model
from fleetllm.models.quant import quantize_model
from fleetllm.speculative.config import SpeculativeConfig
from fleetllm.speculative.decoder import SpecDecoder
from fleetllm.speculative.verify import verify
from fleetllm.structured.matcher import allocate_masks, apply_masks

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from fleetllm.engine.engine import EngineConfig


class ModelExecutor:
    needs_warm_up = True

    def __init__(self, cfg: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """Load the model (unless ``loaded`` is given), size and allocate the KV cache, set up speculation."""
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = cfg.resolved_device()
        if self.device == "cpu":
            health.statuses(wait=False)  # the kernels load (or build, in a checkout) while the weights load
        dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        self.loaded = loaded or load_model(cfg.model, device=self.device, dtype=dtype, name=cfg.served_model_name,
                                             store=cfg.store)
        if cfg.quantization != "none" and self.device == "cpu":  # a quantised copy: shared weights stay as loaded
            model = quantize_model(self.loaded.model, cfg.quantization, cfg.batch_invariant)
            self.loaded = replace(self.loaded, model=model)
        self.step_profile = StepProfile() if cfg.profile_steps else None
        # hooks on the model: an engine sharing these weights with others removes them when done profiling
        self.attention_hooks = time_attention(self.loaded.model, self.step_profile, self.device) if self.step_profile else []
        kv_dtype = kv_dtype_of(cfg.kv_cache_dtype, self.loaded.model, cfg.quantization)
        per_block = ModelRunner.kv_bytes_per_block(self.loaded.model, cfg.block_size, kv_dtype)
        self.num_blocks = cfg.num_blocks or max(16, int(cfg.kv_cache_gb * 2**30 // per_block))
        check_context_fits(cfg, self.loaded.config.max_position_embeddings, self.num_blocks, per_block)
        self.runner = ModelRunner(self.loaded.model, self.num_blocks, cfg.block_size, self.device, kv_dtype,
                                  self.step_profile, shm_dir() if cfg.kv_pool_shared else None)
        self.sampler = Sampler()
        self.step_pause = StepPause()  # the engine arms it per step (--scheduling-policy priority)
        spec_cfg = SpeculativeConfig.parse(cfg.speculative)
        self.spec = SpecDecoder(spec_cfg, self.loaded, self.runner, self.device) if spec_cfg else None
        if self.step_profile:  # adaptive K timed steps of its own through the runner: they are no serving steps
            self.step_profile.reset()
        # the C kernels this process runs: a missing one is an ERROR line (fatal with FLEETLLM_REQUIRE_KERNELS=1)
        self.kernels = health.check() if self.device == "cpu" else []

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        batch = sched.scheduled
        for s in batch:
            if s.seq.generator is None and s.seq.params.seed is not None:
                s.seq.generator = _generator(s.seq)
        rows, first = _logit_rows(batch)
        verifying = any(s.draft_token_ids for s in batch)
        t0 = time.perf_counter()
        logits, aux = self.runner.execute(batch, rows, self.spec.aux_layers if self.spec else None,
                                          sched.kv_connector_metadata, self.step_pause)
        out = ModelOutput()
        with phase(self.step_profile, "sampling"):
            if not verifying and _all_plain_greedy(batch):
                _argmax(batch, logits, out)  # no host copy of the logits: only the ids come back
            else:
                logits = logits.float().cpu()  # sampling runs on the host
                if verifying and self.spec:
                    self.spec.verify_seconds += time.perf_counter() - t0
                self._sample(batch, logits, first, out)
                if verifying:
                    self._verify(batch, logits, first, out)
        if aux is not None:
            self._observe(batch, aux, out)
        return out

    def _sample(self, batch: list[Scheduled], logits: torch.Tensor, first: list[int], out: ModelOutput) -> None:
        """One token for each request at the end of its tokens without drafts to verify."""
        plain = [i for i, s in enumerate(batch) if s.num_logits and not s.draft_token_ids]
        if not plain:
            return
        seqs = [batch[i].seq for i in plain]
        res = self.sampler(
            logits[[first[i] for i in plain]],
            [q.params for q in seqs],
            [q.generator for q in seqs],
            [q.prompt_token_ids for q in seqs],
            [q.output_token_ids for q in seqs],
            _grammar_masks(seqs, logits.shape[-1]),
        )
        for j, seq in enumerate(seqs):
            tok = res.token_ids[j]
            lps = None if seq.params.logprobs is None else [TokenLogprob(tok, res.logprobs[j], res.top_logprobs[j])]
            out.sampled[seq.request_id] = Sampled([tok], lps)

    def _verify(self, batch: list[Scheduled], logits: torch.Tensor, first: list[int], out: ModelOutput) -> None:
        """Accepted drafts plus one target token for each request verifying drafts."""
        for i, s in enumerate(batch):
            if not s.draft_token_ids:
                continue
            raw = rows = logits[first[i] : first[i] + s.num_logits]
            if s.seq.grammar is not None:  # each row masked by the grammar's state after the drafts before it
                masks = allocate_masks(len(rows), rows.shape[-1])
                s.seq.grammar.fill_masks_through(masks, 0, s.draft_token_ids)
                rows = apply_masks(rows, masks)
            if self.spec:
                toks = self.spec.verify(s.seq, rows, s.draft_token_ids)
            else:  # a grammar's forced tokens, drafted without a speculative decoder
                toks = verify(rows, s.draft_token_ids, s.seq.params, s.seq.generator)
            k = s.seq.params.logprobs  # reported from the raw logits, as the sampler does
            out.sampled[s.seq.request_id] = Sampled(toks, None if k is None else _logprobs(raw, toks, k))

    def _observe(self, batch: list[Scheduled], aux: torch.Tensor, out: ModelOutput) -> None:
        """Hand the drafter the target's features of the positions that stay computed (not rejected drafts)."""
        t = 0
        for s in batch:
            seq, start = s.seq, t
            t += s.num_new_tokens
            sampled = out.sampled.get(seq.request_id)
            n = s.num_computed(sampled.token_ids if sampled else [])
            self.spec.drafter.observe(seq, seq.num_computed_tokens, aux[start : start + n])

    def propose(self, seqs: list[Sequence], max_model_len: int) -> dict[str, list[int]]:
        return self.spec.propose(seqs, max_model_len) if self.spec else {}

    def forget(self, seq: Sequence) -> None:
        if self.spec:
            self.spec.drafter.forget(seq)

    def register_kv_connector(self, connector: KVConnectorWorker | None) -> None:
        self.runner.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_caches())

    def kv_caches(self) -> KVCaches:
        bs = self.runner.block_size
        views = [(k.view(self.num_blocks, bs, *k.shape[1:]), v.view(self.num_blocks, bs, *v.shape[1:]))
                 for k, v in self.runner.kv_cache]
        return KVCaches(views, self.runner.pool_file)


def check_context_fits(cfg: EngineConfig, model_max: int, num_blocks: int, per_block: int) -> None:
    """Refuse (UsageError) a ``--max-model-len`` that one sequence could not reach in a pool of ``num_blocks``
    blocks of ``per_block`` bytes, saying what pool would hold it, rather than serve a shorter context silently
    (the engine caps its context by the pool: 1 GiB holds 28k tokens of Gemma 3 270M's fp32 KV, not 32k)."""
    asked = min(cfg.max_model_len or 0, model_max)
    watermark = SchedulerConfig.watermark  # blocks admission keeps free (the engine's ``fits``)
    if (num_blocks - int(watermark * num_blocks)) * cfg.block_size >= asked:
        return
    need = int(-(-asked // cfg.block_size) / (1 - watermark)) + 2
    more = f"--num-blocks {need}" if cfg.num_blocks else f"--kv-cache-gb {math.ceil(need * per_block / 2**30 * 100) / 100}"
    raise UsageError(f"--max-model-len {cfg.max_model_len}: a KV cache of {num_blocks} blocks holds "
                     f"{(num_blocks - int(watermark * num_blocks)) * cfg.block_size} tokens of one sequence "
                     f"({per_block // cfg.block_size} bytes per token); give {more} or more")


def _generator(seq: Sequence) -> torch.Generator:
    """A seeded request's sampling RNG: from its seed, or from the state a prefill elsewhere left it in."""
    g = torch.Generator().manual_seed(seq.params.seed)
    if seq.sampler_state is not None:
        g.set_state(torch.frombuffer(bytearray(seq.sampler_state), dtype=torch.uint8))
    return g


def _all_plain_greedy(batch: list[Scheduled]) -> bool:
    """Every request samples greedily from raw logits: no logprobs, penalties or grammar to apply."""
    return all(s.seq.params.greedy and s.seq.params.logprobs is None and not s.seq.params.needs_penalties
               and s.seq.grammar is None for s in batch)


def _argmax(batch: list[Scheduled], logits: torch.Tensor, out: ModelOutput) -> None:
    """Greedy tokens for a batch whose logits rows are one per sampling request, in batch order; one
    device->host copy for the whole batch."""
    ids = logits.argmax(dim=-1).tolist()
    for s, tok in zip((s for s in batch if s.num_logits), ids, strict=True):
        out.sampled[s.seq.request_id] = Sampled([tok])


def time_attention(model: torch.nn.Module, profile: StepProfile, device: str) -> list[RemovableHandle]:
    """Add every attention module's time to ``profile`` (hooks; only with ``--profile-steps``). On an
    accelerator each hook synchronizes, so the times are the kernels' and the step is slower."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    started: list[float] = []

    def pre(*_: object) -> None:
        sync()
        started.append(time.perf_counter())

    def post(*_: object) -> None:
        sync()
        profile.add("attention", time.perf_counter() - started.pop())

    attns = [layer.attn for layer in getattr(model, "layers", [])]
    return [a.register_forward_pre_hook(pre) for a in attns] + [a.register_forward_hook(post) for a in attns]


def _grammar_masks(seqs: list[Sequence], vocab_size: int) -> torch.Tensor | None:
    """One bitmask row per sequence (all allowed for unconstrained ones), None when none is constrained."""
    if all(q.grammar is None for q in seqs):
        return None
    masks = allocate_masks(len(seqs), vocab_size)
    for row, q in enumerate(seqs):
        if q.grammar is not None:
            q.grammar.fill_mask(masks, row)
    return masks


def _logit_rows(batch: list[Scheduled]) -> tuple[list[int], list[int]]:
    """Rows of the flat batch whose logits are needed, and where each request's rows start among them."""
    rows: list[int] = []
    first: list[int] = []
    t = 0
    for s in batch:
        t += s.num_new_tokens
        first.append(len(rows))
        rows.extend(range(t - s.num_logits, t))
    return rows, first


def _logprobs(logits: torch.Tensor, toks: list[int], k: int) -> list[TokenLogprob]:
    """Log-probabilities of ``toks`` (one per row of ``logits``) and each row's top ``k``."""
    lp = torch.log_softmax(logits[: len(toks)], dim=-1)
    out = []
    for r, tok in enumerate(toks):
        top = []
        if k > 0:
            vals, idx = lp[r].topk(k)
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        out.append(TokenLogprob(tok, float(lp[r, tok]), top))
    return out
