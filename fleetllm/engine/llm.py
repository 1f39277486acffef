"""The embedding API: run the engine in-process, no HTTP.

    llm = LLM("smollm2-135m")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from fleetllm.engine.engine import EngineConfig, LLMEngine, TokenLogprob
from fleetllm.engine.sampling import SamplingParams
from fleetllm.kvtier.attach import attach_tiers
from fleetllm.models.loader import LoadedModel


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int = 0


class LLM:
    """Offline generation over a batch of prompts, with continuous batching inside."""

    def __init__(self, model: str = "smollm2-135m", loaded: LoadedModel | None = None, **engine_kwargs: Any) -> None:
        """``loaded`` reuses weights already in memory (several engines over one model, as in tests)."""
        cfg = EngineConfig(model=model, **engine_kwargs)
        self.engine = LLMEngine(cfg, loaded=loaded)
        # the KV tiers the config asks for, as a worker attaches them (their writes finish at close())
        self.kv_tiers = attach_tiers(self.engine, cfg.kv_offload_gb, cfg.kv_disk_dir, cfg.kv_disk_gb, cfg.kv_remote,
                                     cfg.kv_offload_dtype)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Finish the KV tiers' queued writes and release them (nothing to do without tiers)."""
        for tier in self.kv_tiers:
            tier.close()

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` as ``name`` (needs ``enable_lora=True``); raises ``LoraError``."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name``; raises ``LoraError`` (404) when it is not loaded."""
        self.engine.unload_lora(name)

    def generate(
        self, prompts: str | list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
        lora_name: str | list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for each prompt (text, or token ids); results in prompt order. ``lora_name``: the adapter of
        every prompt, or one per prompt (None: the base model); all run in the same batches."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        results: list[GenerationResult] = []
        owner: dict[str, tuple[GenerationResult, Completion]] = {}
        for prompt, p, lora in zip(prompts, plist, loras, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            res = GenerationResult(str(next(self._ids)), ids, [])
            results.append(res)
            for i in range(p.n):
                sub = p if p.seed is None or i == 0 else _with_seed(p, p.seed + i)
                rid = f"{res.request_id}-{i}"
                comp = Completion(i, logprobs=[] if p.logprobs is not None else None)
                res.outputs.append(comp)
                owner[rid] = (res, comp)
                self.engine.add_request(rid, ids, sub, lora_name=lora)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res, comp = owner[out.request_id]
                comp.token_ids.extend(out.new_token_ids)
                comp.text += out.new_text
                if out.logprobs and comp.logprobs is not None:
                    comp.logprobs.extend(out.logprobs)
                if out.finished:
                    comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                    res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
                    if out.error:
                        raise RuntimeError(out.error)
        return results

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> GenerationResult:
        """Apply the model's chat template to ``messages`` and generate one reply."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]  # the template has its BOS


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(p, seed=seed)
