"""What the engine asks of speculative decoding: draft for the next step, verify this step's drafts.

K per request: with ``adaptive`` each request keeps a decayed estimate of its per-token acceptance
probability a; the expected tokens from a verify of K drafts are (1 - a^(K+1)) / (1 - a), and its cost
relative to a plain step is ``cost(B * (1+K)) / cost(B)`` for B decoding sequences (the target's step
time measured over token counts at start-up) plus the drafting cost. The K with the best tokens per
unit of time wins; K = 0 (no speculation) whenever nothing beats a plain step by ``MIN_GAIN``, with a cheap probe
every ``PROBE_EVERY`` steps so a request whose text becomes predictable can win speculation back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fleetllm.engine.sequence import Sequence
from fleetllm.models.llama import AttentionMetadata, LlamaModel, PrefillChunk
from fleetllm.speculative.config import SpeculativeConfig
from fleetllm.speculative.drafter import create_drafter
from fleetllm.speculative.verify import verify

PRIOR_ACCEPT, PRIOR_WEIGHT = 0.6, 2.0  # a request starts as if 2 drafts had been tried, 60% accepted
DECAY = 0.8  # older verify steps count less: acceptance drifts with the text
PROBE_EVERY = 16
# A K > 0 must beat plain decoding by this much: the measured step cost leaves out speculation's own
# per-step work (verification, features, bookkeeping), which matters when the expected gain is thin.
MIN_GAIN = 1.10


@dataclass
class RequestSpecState:
    accepted: float = PRIOR_ACCEPT * PRIOR_WEIGHT
    tried: float = PRIOR_WEIGHT
    steps_off: int = 0

    @property
    def accept_rate(self) -> float:
        return min(self.accepted / max(self.tried, 1e-9), 0.98)

    def update(self, k: int, accepted: int) -> None:
        # geometric model: accepted successes, then one failure unless all k passed
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (1 if accepted < k else 0)


class StepCost:
    """Target step time as a function of tokens in the step, measured once (piecewise linear)."""

    SIZES = (1, 2, 4, 8, 9, 16, 32, 64)
    _cache: dict[tuple[int, int], list[float]] = {}

    def __init__(self, model: LlamaModel, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = (id(model), torch.get_num_threads())
        if key not in self._cache:
            self._cache[key] = [self._measure(model, kv_cache, n) for n in self.SIZES]
        self.times = self._cache[key]

    @staticmethod
    @torch.inference_mode()
    def _measure(model: LlamaModel, kv_cache: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> float:
        # Scratch slots 0..n-1: called before any request, so no cached block is overwritten.
        slots = torch.arange(n, device=kv_cache[0][0].device)
        meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, n, slots, fresh=True)])
        ids = torch.zeros(n, dtype=torch.long, device=slots.device)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.compute_logits(model(ids, slots, meta, kv_cache)[-1:])
            if slots.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]

    def __call__(self, n: int) -> float:
        sizes, times = self.SIZES, self.times
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                f = (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
                return times[i - 1] + f * (times[i] - times[i - 1])
        return times[-1] * n / sizes[-1]


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, loaded, kv_cache, device: str = "cpu") -> None:
        self.cfg = cfg
        self.drafter = create_drafter(cfg.method, loaded=loaded, head=cfg.head, device=device)
        self.aux_layers = self.drafter.aux_layers
        self.max_k = cfg.k or cfg.max_k
        self.cost = StepCost(loaded.model, kv_cache) if cfg.adaptive else None
        self.draft_cost = 0.0  # seconds per drafting call (per draft token if not one_pass), running average
        # counters (AL = 1 + accepted / verify_steps)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.accepted_per_pos = [0] * self.max_k
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0
        self._k_cache: dict[tuple[int, int], int] = {}

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 1.0

    # ---- drafting ------------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], max_model_len: int) -> dict[str, list[int]]:
        """Draft tokens for the next step of ``seqs`` (running, one token from decode), by request id;
        a request drafting nothing is left out."""
        if not seqs:
            return {}
        ks = []
        for seq in seqs:
            if seq.spec_state is None:
                seq.spec_state = RequestSpecState()
            room = min(seq.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens) - 1
            k = 0 if seq.params.needs_penalties else min(self._choose_k(seq.spec_state, len(seqs)), room)
            ks.append(max(k, 0))
        if not any(ks):
            return {}
        t0 = time.perf_counter()
        drafts = self.drafter.propose(seqs, ks)
        dt = time.perf_counter() - t0
        self.draft_seconds += dt
        unit = dt if self.drafter.one_pass else dt / max(ks)
        self.draft_cost = unit if not self.draft_cost else 0.8 * self.draft_cost + 0.2 * unit
        return {seq.request_id: list(d[:k]) for seq, d, k in zip(seqs, drafts, ks, strict=True) if k and d}

    def _choose_k(self, st: RequestSpecState, batch: int) -> int:
        if not self.cfg.adaptive:
            return self.max_k
        a = round(st.accept_rate, 2)
        key = (int(a * 100), batch, int(self.draft_cost * 2000))
        if key not in self._k_cache:
            self._k_cache[key] = self._best_k(a, batch)
        k = self._k_cache[key]
        if k == 0:
            st.steps_off += 1
            if st.steps_off >= PROBE_EVERY:
                st.steps_off = 0
                return min(2, self.max_k)
        return k

    def _best_k(self, a: float, batch: int) -> int:
        base = self.cost(batch)
        best_k, best = 0, MIN_GAIN / 1.02
        for k in range(1, self.max_k + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            draft = self.draft_cost * (1 if self.drafter.one_pass else k)
            gain = tokens / ((self.cost(batch * (1 + k)) + draft) / base)
            if gain > best * 1.02:  # a K must clearly beat plain decode (MIN_GAIN) and the next-smaller K
                best_k, best = k, gain
        return best_k

    # ---- verification --------------------------------------------------------------------------------
    def verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """The tokens ``seq`` emits this step (accepted drafts + one target token); updates the counters."""
        tokens = verify(logits, drafts, seq.params, seq.generator)
        accepted = len(tokens) - 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        if seq.spec_state is not None:
            seq.spec_state.update(len(drafts), accepted)
        return tokens
