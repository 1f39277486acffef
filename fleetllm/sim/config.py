"""The simulated engine's settings (torch-free).

The scheduler and cache knobs are the real engine's: same names, so ``fleetllm worker --simulate`` fills
them from the engine's flags, and the same defaults. The timing model adds ``speed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetllm.cli_options import opt
from fleetllm.engine.config import EngineConfig


@dataclass
class SimConfig:
    """A simulated engine: the real scheduler and prefix cache, a timing model for the model."""

    model_name: str = EngineConfig.model
    max_model_len: int = 8192
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    max_waiting: int = EngineConfig.max_waiting
    scheduling_policy: str = EngineConfig.scheduling_policy
    priority_aging_s: float = EngineConfig.priority_aging_s
    num_blocks: int | None = None  # default: the profile's
    block_size: int | None = None  # default: the profile's
    enable_prefix_caching: bool = True
    default_max_tokens: int = 64  # when a request gives none
    speed: float = opt(1.0, "--simulate: run the timing model this much faster", flag="--sim-speed")
