"""A simulated worker's engine: the real :class:`fleetllm.engine.engine.LLMEngine` (scheduler, block
pool, prefix cache, KV events, metrics, stop checks) over the :class:`TimingExecutor`, so the same
HTTP server runs over it and it behaves as the real engine does, only without a model.
"""

from __future__ import annotations

from fleetllm.engine.engine import EngineConfig, LLMEngine
from fleetllm.models.config import ModelConfig
from fleetllm.models.tokenizer import TokenizerWrapper
from fleetllm.sim.config import SimConfig
from fleetllm.sim.executor import SimulatedModel, TimingExecutor
from fleetllm.sim.profile import TimingProfile


def sim_engine(cfg: SimConfig, tokenizer: TokenizerWrapper, model_config: ModelConfig,
               profile: TimingProfile | None = None, identity: dict[str, str] | None = None) -> LLMEngine:
    """An engine over the timing model of ``profile`` (default: the shipped one); ``identity`` labels its metrics."""
    profile = profile or TimingProfile.default()
    num_blocks = cfg.num_blocks or profile.num_blocks
    engine_cfg = EngineConfig(
        model=cfg.model_name, device="cpu", block_size=cfg.block_size or profile.block_size, num_blocks=num_blocks,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_waiting=cfg.max_waiting,
        enable_prefix_caching=cfg.enable_prefix_caching, metric_labels=identity or {},
        scheduling_policy=cfg.scheduling_policy, priority_aging_s=cfg.priority_aging_s,
        enable_lora=cfg.enable_lora, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
        max_cpu_loras=cfg.max_cpu_loras,
    )
    executor = TimingExecutor(SimulatedModel(cfg.model_name, model_config, tokenizer), profile, num_blocks, cfg.speed,
                              cfg.lora_load_s)
    return LLMEngine(engine_cfg, executor=executor, default_max_tokens=cfg.default_max_tokens)
