"""The router's view of a prompt: the same token ids and block hashes the engine will compute.

The chat template is applied before hashing, exactly as the worker does, so a returning conversation's
blocks hash the same on both sides (router tokens != engine tokens is a classic way to lose affinity).
Tokenizers load without weights or PyTorch (:func:`fleetllm.models.source.load_tokenizer`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from fleetllm.engine.block_pool import block_key, hash_prefix_blocks
from fleetllm.models.tokenizer import TokenizerWrapper
from fleetllm.server.anthropic import chat_body as anthropic_chat_body
from fleetllm.server.protocol import APIError, chat_messages
from fleetllm.tools.parsers import parser_for
from fleetllm.tools.request import render_prompt, tool_request

log = logging.getLogger(__name__)


_LOADED: dict[str, TokenizerWrapper] = {}  # tokenizers loaded in this process, by model reference


class PromptTokenizer:
    """Tokenizers by served model name, loaded on first use; ``refs`` maps a served name to a model
    reference when the name alone does not resolve (e.g. ``--served-model-name``)."""

    def __init__(self, refs: dict[str, str] | None = None) -> None:
        self.refs = refs or {}
        self._cache: dict[str, TokenizerWrapper | None] = {}
        self._loading = threading.Lock()  # requests tokenise on worker threads: load each tokenizer once

    def tokenizer(self, model: str) -> TokenizerWrapper | None:
        with self._loading:
            return self._load(model)

    def preload(self, models: list[str]) -> None:
        """Load ``models``' tokenizers now (a router starting, on a thread): loaded on first use, a tokenizer took
        ~0.2 s of CPU that the first requests of a prefix-aware router waited for (their TTFT 140-300 ms)."""
        for model in models:
            self.tokenizer(model)

    def loaded(self, model: str) -> bool:
        """Whether ``model``'s tokenizer was loaded (or found missing) already."""
        return model in self._cache

    def _load(self, model: str) -> TokenizerWrapper | None:
        if model not in self._cache:
            from fleetllm.models.source import load_tokenizer

            ref = self.refs.get(model, model)
            try:
                if ref not in _LOADED:  # routers of one process (a test session, a simulated fleet) load it once
                    _LOADED[ref] = load_tokenizer(ref)[1]
                self._cache[model] = _LOADED[ref]
            except Exception as e:  # an unknown model only costs prefix affinity, never the request
                log.warning("no tokenizer for model %r (%s): prefix-aware routing falls back to load", model, e)
                self._cache[model] = None
        return self._cache[model]

    def token_ids(self, model: str, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the worker will see them, or None if they can't be known here."""
        tok = self.tokenizer(model)
        if tok is None:
            return None
        try:
            if path.endswith(("/chat/completions", "/messages")):
                return tok.encode_pieces(chat_prompt(tok, path, body))  # a returning chat: its new turn only
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: route by its first prompt
            if isinstance(prompt, str):
                return tok.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 2**31 for t in prompt):
                return list(prompt)  # ids no vocabulary has are the worker's to refuse
        except (APIError, Exception):  # the worker will answer the bad request with its own error
            return None
        return None


def chat_prompt(tok: TokenizerWrapper, path: str, body: dict[str, Any]) -> str:
    """The prompt text a worker renders for a chat (or Messages) request, tools included."""
    if path.endswith("/messages"):
        body = anthropic_chat_body(body)
    tools = tool_request(body, parser_for("auto", tok.chat_template))
    return render_prompt(tok, chat_messages(body), tools, body.get("add_generation_prompt", True),
                         **(body.get("chat_template_kwargs") or {}))


def block_hashes(token_ids: list[int], block_size: int, model: str, lora_name: str | None = None) -> list[int]:
    """The engine's prefix-cache keys for ``token_ids`` (see :class:`fleetllm.engine.kv_cache_manager.KVCacheManager`),
    under LoRA adapter ``lora_name`` when one is named (its KV is its own: no prefix is shared across adapters)."""
    return hash_prefix_blocks(token_ids, block_size, block_key(model, lora_name))
