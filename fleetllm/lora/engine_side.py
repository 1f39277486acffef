"""The engine's adapters set up from its config: the step's tables on the model runner, the manager over them."""

from __future__ import annotations

from typing import Any

from fleetllm.errors import UsageError
from fleetllm.lora.peft_format import ModelSpec
from fleetllm.lora.registry import LoraManager
from fleetllm.lora.tables import LoraTables


def lora_manager(cfg: Any, executor: Any, model_name: str) -> LoraManager:
    """The :class:`LoraManager` of an engine with ``--enable-lora`` (``cfg``: its EngineConfig). A real executor's
    model runner gets the tables it applies each step; a simulated executor (no runner) keeps the bookkeeping only.
    Raises :class:`UsageError` for limits out of range or a model family the op-by-op path cannot adapt."""
    if cfg.max_loras < 1 or cfg.max_lora_rank < 1 or (cfg.max_cpu_loras is not None and cfg.max_cpu_loras < 0):
        raise UsageError("--max-loras and --max-lora-rank must be at least 1, --max-cpu-loras at least 0")
    spec = ModelSpec.of(executor.loaded.config, model_name)
    tables = None
    runner = getattr(executor, "runner", None)
    if runner is not None:
        from fleetllm.models.llama import LlamaModel

        if not isinstance(runner.model, LlamaModel):
            raise UsageError(f"--enable-lora: {executor.loaded.config.architecture} models take no adapters yet")
        tables = LoraTables(spec.shapes, spec.num_layers, cfg.max_loras, cfg.max_lora_rank, runner.device)
        runner.lora_tables = tables
    return LoraManager(spec, tables, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras)
