"""The simulated engine's settings (torch-free).

The scheduler, cache and LoRA knobs are the real engine's: same names, so ``fleetllm worker --simulate`` fills
them from the engine's flags, and the same defaults. The timing model adds ``speed`` and ``lora_load_s``.
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
    enable_lora: bool = EngineConfig.enable_lora  # adapters: the engine's registry, bookkeeping only (no weights)
    max_loras: int = EngineConfig.max_loras
    max_lora_rank: int = EngineConfig.max_lora_rank
    max_cpu_loras: int | None = EngineConfig.max_cpu_loras
    lora_load_s: float = opt(0.05, "--simulate: seconds a step spends bringing a LoRA adapter that is not resident "
                                   "into the step's tables (from the node's cache)", flag="--sim-lora-load")
