"""The serving side's LoRA flags of ``fleetllm worker`` (the engine's own, ``--enable-lora``, ``--max-loras``,
``--max-lora-rank`` and ``--max-cpu-loras``, are :class:`~fleetllm.engine.config.EngineConfig` fields).

Named as vLLM names them, so a vLLM command line's LoRA flags work unchanged. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetllm.cli_options import opt


@dataclass
class LoraServingOptions:
    """Which adapters a worker serves from its start, and where ``/v1/load_lora_adapter`` may read them."""

    lora_modules: list[str] = opt(
        doc="adapters served from the start: NAME=PATH, or vLLM's JSON form {\"name\": ..., \"path\": ..., "
            "\"base_model_name\": ...}; several per flag, and the flag repeatable; PATH a local directory, "
            "hf://org/name[@revision] or s3://bucket/prefix (through the model store)",
        factory=list, many=True, metavar="NAME=PATH")
    allowed_local_lora_paths: list[str] = opt(
        doc="local directories adapters may be loaded from (default: the parent directories of the "
            "--lora-modules paths and the model store's cache)", factory=list, many=True, metavar="DIR")
