"""The executor seam: what the engine asks of whatever does a step's model work.

The engine's step is schedule -> ``execute`` -> update from the output -> ``propose`` (drafts for the
next step). Two executors implement it: :class:`fleetllm.engine.model_executor.ModelExecutor` (the
model runner's forward pass, the sampler, speculative verification and drafting) and
:class:`fleetllm.sim.executor.TimingExecutor` (sleeps for the step time a calibrated profile predicts,
emits synthetic tokens). Everything after a step (computed counts, prefix caching, appends, stops,
finishing, metrics) is the engine's, once, for both.

Torch-free: the simulated worker runs the engine without loading PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fleetllm.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from fleetllm.engine.kv_connector.base import KVCaches, KVConnectorWorker
    from fleetllm.engine.scheduler import SchedulerOutput
    from fleetllm.engine.sequence import Sequence
    from fleetllm.engine.step_pause import StepPause
    from fleetllm.models.config import ModelConfig
    from fleetllm.models.tokenizer import TokenizerWrapper
    from fleetllm.speculative.decoder import SpecDecoder


@dataclass
class Sampled:
    """The tokens one request emits this step, in order: one sampled token, or (verifying K drafts)
    the accepted drafts followed by one target token (the correction, or the bonus when all pass)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them


@dataclass
class ModelOutput:
    """What a step's model work produced, per request id; a request mid-prompt samples nothing."""

    sampled: dict[str, Sampled] = field(default_factory=dict)


class ServedModel(Protocol):
    """The model an executor runs, as the engine and the worker see it."""

    name: str
    config: ModelConfig
    tokenizer: TokenizerWrapper
    load_seconds: float


class Executor(Protocol):
    loaded: ServedModel
    device: str  # "cpu", "cuda", ...
    num_blocks: int  # KV blocks it holds; the engine's block pool has exactly these
    needs_warm_up: bool  # first calls pay one-off costs (allocator, kernels) worth paying before serving
    spec: SpecDecoder | None  # the speculative decoder (its counters feed the metrics), None without
    step_pause: StepPause | None  # what may pause a running step between layers (None: its steps never pause)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Compute the scheduled tokens and sample (or verify drafts) where a request reaches its end."""
        ...

    def propose(self, seqs: list[Sequence], max_model_len: int) -> dict[str, list[int]]:
        """Draft tokens for the next step of ``seqs`` (running, one token from decode), by request id."""
        ...

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished: drop what is kept for it."""
        ...

    def kv_caches(self) -> KVCaches | None:
        """The KV cache tensors (None: none, as in the timing model)."""
        ...

    def register_kv_connector(self, connector: KVConnectorWorker | None) -> None:
        """Drive ``connector``'s worker side in every step (None: none), its caches given to it first."""
        ...
