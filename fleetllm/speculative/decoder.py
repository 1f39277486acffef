"""What the engine asks of speculative decoding: draft for the next step, verify this step's drafts.

K per request: with ``adaptive`` each request keeps a decayed estimate of its per-draft acceptance
probability, and :func:`~fleetllm.speculative.adaptive_k.choose_ks` splits drafts over the batch so that
the step emits the most tokens per second, counting the target's measured step time by row count and
verifying requests and what each request's context adds to it (:mod:`fleetllm.speculative.step_cost`),
what checking a verify's drafts took so far, and drafting. Nobody drafts when that does not beat a plain step by ``MIN_GAIN``; a request left without
drafts for ``PROBE_EVERY`` steps (more in a batch where a probe's rows are dear: probes take at most
``PROBE_BUDGET`` of the time) gets a probe of ``PROBE_K`` drafts so that, if its text became predictable,
it can win speculation back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fleetllm.engine.sequence import Sequence
from fleetllm.speculative.adaptive_k import choose_ks
from fleetllm.speculative.config import SpeculativeConfig
from fleetllm.speculative.drafter import create_drafter
from fleetllm.speculative.step_cost import StepCost
from fleetllm.speculative.verify import verify

if TYPE_CHECKING:
    from fleetllm.engine.model_runner import ModelRunner

PRIOR_ACCEPT, PRIOR_WEIGHT = 0.6, 2.0  # a request starts as if 2 drafts had been tried, 60% accepted
DECAY = 0.8  # older verify steps count less: acceptance drifts with the text
PROBE_EVERY = 16  # steps without drafts before a request's probe, at the least
PROBE_K = 2
PROBE_BUDGET = 0.02  # the share of step time probes may take: in wide batches, where rows are dear, they come rarer
RUNNING = 0.2  # weight of the newest measure in the running averages of drafting and checking times


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


def _seeded_sampling(seq: Sequence) -> bool:
    """Whether a request samples with a seed: which tokens a seed draws depends on the drafts it verified, so where
    drafts depend on more than the request itself (:attr:`SpecDecoder.varying_drafts`) it drafts nothing, and the
    same seeded request answers the same every time. Greedy requests are unaffected (drafts never change their
    tokens)."""
    return seq.params.seed is not None and seq.params.temperature > 0


def _running(old: float, new: float) -> float:
    return new if not old else old + RUNNING * (new - old)


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, loaded, runner: ModelRunner | None, device: str = "cpu") -> None:
        """``runner``: the target's model runner, whose steps adaptive K times at start-up."""
        self.cfg = cfg
        self.drafter = create_drafter(cfg.method, loaded=loaded, head=cfg.head, device=device,
                                      session_tokens=cfg.session_tokens)
        self.aux_layers = self.drafter.aux_layers
        self.max_k = cfg.k or cfg.max_k
        # drafts depend on other requests: adaptive K reads the batch and measured costs; suffix drafting reads the
        # history of earlier requests
        self.varying_drafts = bool(cfg.adaptive) or bool(getattr(self.drafter, "shares_history", False))
        self.cost = StepCost.measure(runner) if cfg.adaptive and runner is not None else None
        self.draft_cost = 0.0  # seconds per drafting call (per draft token if not one_pass), running average
        self.check_cost = 0.0  # seconds to check one request's drafts after the forward, running average
        # counters (AL = 1 + accepted / verify_steps)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.accepted_per_pos = [0] * self.max_k
        # (drafts, draft tokens, accepted) by the LoRA adapter of the verified request ("": the base model): a
        # drafter that knows only the base model (an EAGLE head) is measured against each adapter it drafts for
        self.by_lora: dict[str, list[int]] = {}
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 1.0

    # ---- drafting ------------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], max_model_len: int) -> dict[str, list[int]]:
        """Draft tokens for the next step of ``seqs`` (running, one token from decode), by request id;
        a request drafting nothing is left out."""
        if not seqs:
            return {}
        caps = []
        for seq in seqs:
            if seq.spec_state is None:
                seq.spec_state = RequestSpecState()
            room = min(seq.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens) - 1
            seeded = self.varying_drafts and _seeded_sampling(seq)
            caps.append(0 if seq.params.needs_penalties or seeded else max(0, min(self.max_k, room)))
        probes = self._probes(seqs, caps)
        ks = self.choose(seqs, caps, probes, drafting=True)
        if not any(ks):
            return {}
        t0 = time.perf_counter()
        drafts = self.drafter.propose(seqs, ks)
        dt = time.perf_counter() - t0
        self.draft_seconds += dt
        self.draft_cost = _running(self.draft_cost, dt if self.drafter.one_pass else dt / max(ks))
        # drafts may come back shorter: split again over what was drafted (drafting is paid for by now)
        ks = self.choose(seqs, [len(d[:k]) for d, k in zip(drafts, ks, strict=True)], probes, drafting=False)
        return {seq.request_id: list(d[:k]) for seq, d, k in zip(seqs, drafts, ks, strict=True) if k}

    def choose(self, seqs: list[Sequence], caps: list[int], probes: list[int], drafting: bool) -> list[int]:
        """Drafts per request (``caps`` the most each may get; ``probes`` the least); counts steps without."""
        if self.cost is None:
            return caps
        unit = self.draft_cost if drafting else 0.0
        per_k = not self.drafter.one_pass
        cost = self.cost
        ks = choose_ks([q.spec_state.accept_rate for q in seqs], caps, self._step_seconds,
                       lambda longest: unit * (longest if per_k else 1) if longest else 0.0, probes,
                       context=lambda i, k: cost.context_seconds(k, seqs[i].num_tokens))
        for seq, k in zip(seqs, ks, strict=True):
            seq.spec_state.steps_off = 0 if k else seq.spec_state.steps_off + drafting
        return ks

    def _probes(self, seqs: list[Sequence], caps: list[int]) -> list[int]:
        """``PROBE_K`` drafts for each request that has gone ``probe_every`` steps without any."""
        if self.cost is None:
            return [0] * len(seqs)
        every = self.probe_every(len(seqs))
        return [min(PROBE_K, c) if q.spec_state.steps_off >= every - 1 else 0 for q, c in zip(seqs, caps, strict=True)]

    def probe_every(self, batch: int) -> int:
        """Steps between a request's probes in a batch of ``batch``: with one probe in flight per ``every / batch``
        steps, each adding ``PROBE_K`` rows and a verifying request, probes take ``PROBE_BUDGET`` of the time."""
        plain = self._step_seconds(batch, 0)
        share = (self._step_seconds(batch + PROBE_K, 1) - plain) / plain
        return max(PROBE_EVERY, math.ceil(batch * share / PROBE_BUDGET))

    def _step_seconds(self, rows: int, verifying: int) -> float:
        return self.cost(rows, verifying) + verifying * self.check_cost

    # ---- verification --------------------------------------------------------------------------------
    def verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """The tokens ``seq`` emits this step (accepted drafts + one target token); updates the counters."""
        t0 = time.perf_counter()
        tokens = verify(logits, drafts, seq.params, seq.generator)
        self.check_cost = _running(self.check_cost, time.perf_counter() - t0)
        accepted = len(tokens) - 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        tally = self.by_lora.setdefault(seq.lora_name or "", [0, 0, 0])
        tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + len(drafts), tally[2] + accepted
        if seq.spec_state is not None:
            seq.spec_state.update(len(drafts), accepted)
        return tokens
