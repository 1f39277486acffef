"""The timing executor: a step's model work replaced by the time the real engine would take for it.

A step sleeps for what the profile predicts for its batch (decode sequences, prefill tokens, the
decoders' context), counted from when the step began, then emits one synthetic token per request that
reached the end of its tokens. Output text is a fixed cycle of ordinary words (its content is not the
point); it never holds EOS, so ``max_tokens`` and stop strings end a request. No drafts, no KV tensors.

LoRA adapters: the engine's own registry decides which adapter holds which slot of the step's tables (with no
weights behind them); a step that finds a slot holding an adapter it did not hold before pays ``lora_load_s`` per
such slot, the time to bring an adapter into the tables from the node's cache.
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
    step_pause = None  # a simulated step is one sleep: nothing to pause between

    def __init__(self, model: SimulatedModel, profile: TimingProfile, num_blocks: int, speed: float = 1.0,
                 lora_load_s: float = 0.0) -> None:
        """``speed`` > 1 runs the timing model faster than real time; ``lora_load_s``: a LoRA adapter's load."""
        self.loaded = model
        self.lora_load_s = lora_load_s
        self._slots: dict[int, str] = {}  # the adapter each slot of the step's tables held when last run
        self.lora_loads = 0  # adapters brought into a slot
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
        dt += self._adapter_loads(batch) * self.lora_load_s / self.speed
        self.simulated_seconds += dt
        remaining = dt - (time.monotonic() - sched.start_time)
        if remaining > 0:
            time.sleep(remaining)
        return ModelOutput({s.seq.request_id: Sampled([self._next_token(s.seq)]) for s in batch if s.num_logits})

    def _adapter_loads(self, batch: list) -> int:
        """Slots that hold, in this step, an adapter they did not hold when last run: each one was loaded."""
        loads = 0
        for s in batch:
            name, slot = s.seq.lora_name, s.seq.lora_slot
            if name is not None and slot >= 0 and self._slots.get(slot) != name:
                self._slots[slot] = name
                loads += 1
        self.lora_loads += loads
        return loads

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
