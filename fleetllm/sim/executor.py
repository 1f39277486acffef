"""The timing executor: a step's model work replaced by the time the real engine would take for it.

A step sleeps for what the profile predicts for its batch (decode sequences, prefill tokens, the
decoders' context), counted from when the step began, then emits one synthetic token per request that
reached the end of its tokens. Output text is a fixed cycle of ordinary words (its content is not the
point); it never holds EOS, so ``max_tokens`` and stop strings end a request. No drafts, no KV tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fleetllm.engine.executor import ModelOutput, Sampled
from fleetllm.engine.scheduler import SchedulerOutput
from fleetllm.engine.sequence import Sequence
from fleetllm.models.config import ModelConfig
from fleetllm.models.tokenizer import TokenizerWrapper
from fleetllm.sim.profile import TimingProfile

_TEXT = ("The fleet routes each request to the replica that already holds its prefix, so the prompt "
         "is not computed twice and the answer starts sooner. ")


@dataclass
class SimulatedModel:
    """What a simulated worker knows of its model: its name, shape and tokenizer, no weights."""

    name: str
    config: ModelConfig
    tokenizer: TokenizerWrapper
    load_seconds: float = 0.0
    root: str = ""  # as LoadedModel: where it came from, and the commit of a store model
    revision: str | None = None


class TimingExecutor:
    device = "cpu"
    needs_warm_up = False  # no weights, no kernels
    spec = None

    def __init__(self, model: SimulatedModel, profile: TimingProfile, num_blocks: int, speed: float = 1.0) -> None:
        """``speed`` > 1 runs the timing model faster than real time."""
        self.loaded = model
        self.profile = profile
        self.num_blocks = num_blocks
        self.speed = speed
        self.simulated_seconds = 0.0
        self._text_ids = model.tokenizer.encode(_TEXT * 4, add_special_tokens=False)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        batch = sched.scheduled
        decode = [s for s in batch if s.seq.output_token_ids and s.num_new_tokens == 1]
        context = sum(s.seq.num_computed_tokens for s in decode)
        dt = self.profile.step_seconds(len(decode), sched.num_tokens - len(decode), context) / self.speed
        self.simulated_seconds += dt
        remaining = dt - (time.monotonic() - sched.start_time)
        if remaining > 0:
            time.sleep(remaining)
        return ModelOutput({s.seq.request_id: Sampled([self._next_token(s.seq)]) for s in batch if s.num_logits})

    def _next_token(self, seq: Sequence) -> int:
        return self._text_ids[seq.num_tokens % len(self._text_ids)]

    def propose(self, seqs: list[Sequence], max_model_len: int) -> dict[str, list[int]]:
        return {}

    def forget(self, seq: Sequence) -> None:
        pass

    def kv_caches(self) -> None:
        return None  # a simulated worker holds no KV tensors

    def register_kv_connector(self, connector: object) -> None:
        return None  # nothing to load or save: the timing model computes no KV
