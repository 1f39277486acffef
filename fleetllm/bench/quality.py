"""How far a fast engine configuration (quantised weights, a smaller KV dtype, ...) is from exact fp32.

Two checks, each against the same engine with ``quantization="none"`` and default settings:

- greedy agreement: the first ``tokens`` greedy tokens (``ignore_eos``) of fixed reference prompts must be
  identical; run once with every prompt in one batch (wide steps) and once prompt by prompt (narrow
  steps), since the fast path picks kernels by step width;
- perplexity on a fixed text: docstrings of installed stdlib modules, gathered in a fixed order (the
  text depends only on the Python version), scored in windows of ``window`` tokens, each fed to the
  engine's own model runner in chunks of ``chunk`` tokens with logits at every row.

``benchmarks/fast_path_quality.py`` is the command line; the test suite runs a small version.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from fleetllm.kernels import wait_for_kernels

REFERENCE_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a child.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Why is the sky blue?",
    "Name a famous physicist and one discovery.",
    "Give three tips for learning a new language.",
    "What are the main causes of ocean tides?",
    "Describe the water cycle in two sentences.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Write a haiku about autumn.",
    "What is the difference between TCP and UDP?",
    "def fibonacci(n):",  # the last four as raw completions, the rest through the chat template
    "SELECT name, email FROM users WHERE",
    "The three laws of thermodynamics are",
    "import numpy as np\n\ndef normalise(v):",
)
RAW_FROM = 12
STDLIB_MODULES = (
    "argparse", "bisect", "collections", "contextlib", "csv", "dataclasses", "datetime", "enum", "functools",
    "heapq", "inspect", "io", "itertools", "json", "logging", "os", "pathlib", "random", "re", "shutil",
    "statistics", "string", "subprocess", "textwrap", "threading", "typing", "unittest", "urllib.parse",
)


def prompt_ids(tokenizer: Any, prompts: tuple[str, ...] = REFERENCE_PROMPTS, raw_from: int = RAW_FROM) -> list[list[int]]:
    """Token ids of the prompts: chat-templated user turns, raw text from index ``raw_from`` on."""
    out = []
    for i, p in enumerate(prompts):
        if i >= raw_from:
            out.append(tokenizer.encode(p))
        else:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}])
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def stdlib_text(tokenizer: Any, max_tokens: int) -> list[int]:
    """About ``max_tokens`` tokens of stdlib docstrings: each module's, then its public members' by name."""
    docs: list[str] = []
    seen: set[str] = set()
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        for _, obj in [(name, mod), *sorted(inspect.getmembers(mod), key=lambda m: m[0])]:
            doc = inspect.getdoc(obj) if not isinstance(obj, (str, int, float, bytes)) else None
            if doc and len(doc) > 80 and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    ids = tokenizer.encode("\n\n".join(docs))
    return ids[:max_tokens]


def greedy(loaded: Any, settings: dict[str, Any], prompts: list[list[int]], tokens: int, one_by_one: bool) -> list[list[int]]:
    """The first ``tokens`` greedy tokens of each prompt, all in one batch or one request at a time (without
    speculation unless ``settings`` ask for it: the check is of the weights' and KV's numerics, and verify steps
    would change which rows share a product)."""
    from fleetllm import LLM, SamplingParams

    llm = LLM(loaded=loaded, **{"speculative": None, **settings})
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    groups = [[p] for p in prompts] if one_by_one else [prompts]
    return [r.outputs[0].token_ids for g in groups for r in llm.generate(g, params)]


def perplexity(loaded: Any, settings: dict[str, Any], ids: list[int], window: int = 512, chunk: int = 512) -> float:
    """exp(mean negative log-likelihood) of ``ids``, in independent windows of ``window`` tokens."""
    from fleetllm.engine.config import EngineConfig
    from fleetllm.engine.model_executor import ModelExecutor
    from fleetllm.engine.params import SamplingParams
    from fleetllm.engine.scheduler import Scheduled
    from fleetllm.engine.sequence import Sequence

    block = EngineConfig.block_size
    cfg = EngineConfig(**{"num_blocks": window // block + 2, **settings})
    runner = ModelExecutor(cfg, loaded).runner
    nll, count = 0.0, 0
    for w0 in range(0, len(ids) - 1, window):
        win = ids[w0 : w0 + window]
        seq = Sequence(f"ppl-{w0}", win, SamplingParams(max_tokens=1), max_tokens=1)
        seq.block_table = list(range(-(-len(win) // cfg.block_size)))
        for c in range(0, len(win), chunk):
            n = min(chunk, len(win) - c)
            logits, _ = runner.execute([Scheduled(seq, n)], list(range(n)))
            seq.num_computed_tokens = c + n
            targets = torch.tensor(win[c + 1 : c + n + 1])
            lp = torch.log_softmax(logits.float()[: len(targets)], dim=-1)
            nll -= lp.gather(1, targets.unsqueeze(1)).sum().item()
            count += len(targets)
    return math.exp(nll / count)


@dataclass
class Quality:
    """A configuration's distance from exact fp32: greedy agreements (of ``prompts``) and perplexities."""

    prompts: int
    agree_batched: int
    agree_one_by_one: int
    ppl: float
    ppl_fp32: float
    text_tokens: int
    text_sha: str

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ppl_fp32


def compare(loaded: Any, settings: dict[str, Any], prompts: list[list[int]], tokens: int, text: list[int],
            window: int = 512, chunk: int = 512, ref_chunk: int | None = None) -> Quality:
    """``settings`` (EngineConfig fields) against ``quantization="none"`` on both checks (the reference's
    perplexity from whole windows in one forward unless ``ref_chunk`` says otherwise)."""
    wait_for_kernels()  # else the first prompts could run on the fp32 fallback while the kernels build
    exact = {"quantization": "none"}
    ref = greedy(loaded, exact, prompts, tokens, one_by_one=False)
    agree = [sum(a == b for a, b in zip(ref, greedy(loaded, settings, prompts, tokens, one), strict=True))
             for one in (False, True)]
    return Quality(
        len(prompts), agree[0], agree[1],
        perplexity(loaded, settings, text, window, chunk), perplexity(loaded, exact, text, window, ref_chunk or window),
        len(text), hashlib.sha256(str(text).encode()).hexdigest()[:12],
    )
