"""fleetllm: an LLM inference serving platform.

The embedding API: ``from fleetllm import LLM, SamplingParams``;
``LLM("smollm2-135m").generate(prompts, SamplingParams(...))``.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:  # lazy: `fleetllm --help` and the router need no torch import
    if name == "LLM":
        from fleetllm.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fleetllm.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
