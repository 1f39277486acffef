"""Compile :class:`GrammarSpec` values into llguidance grammars for one tokenizer, once each.

llguidance was measured against xgrammar on SmolLM2's 49,152-token vocabulary
(``benchmarks/grammar_mask_cost.py``, BENCHMARKS.md): both mask a token in tens of microseconds, far
below a decode step; llguidance builds a new schema's matcher in about a millisecond (xgrammar compiles
for ~20 ms, a stall of the step loop for every new schema), composes schemas inside Lark grammars (the
tool-call grammar) and names the offending part of an invalid schema. Thread-safe: the HTTP thread
validates a request's spec before queueing it, the engine thread builds matchers from the same cache.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance

from fleetllm.structured.matcher import GrammarState
from fleetllm.structured.spec import JSON_STYLE, GrammarSpec

if TYPE_CHECKING:
    from fleetllm.models.tokenizer import TokenizerWrapper


class InvalidGrammar(ValueError):
    """A schema, regex or grammar that does not compile; the message names the problem."""


class GrammarCompiler:
    """Validated llguidance grammars for one tokenizer, LRU-cached by spec."""

    def __init__(self, tokenizer: TokenizerWrapper, eos_token_id: int, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self._eos = eos_token_id
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.hits = self.misses = 0

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it, built on first use (~0.4 s for a 49k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                tok = self._tokenizer
                self._lltok = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=tok.vocab_size, eos_token=self._eos)
            return self._lltok

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A pristine matcher for ``spec`` (shared: copy it before use). Raises :class:`InvalidGrammar`."""
        with self._lock:
            m = self._cache.get(spec)
            if m is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return m
        grammar = to_llguidance(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if is_error:
            raise InvalidGrammar(_tidy(messages[0] if messages else "invalid grammar"))
        m = llguidance.LLMatcher(self.lltokenizer, grammar)
        if m.is_error():
            raise InvalidGrammar(_tidy(m.get_error()))
        with self._lock:
            self.misses += 1
            self._cache[spec] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh grammar state for one request."""
        return GrammarState(self.compile(spec).deep_copy())


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text of ``spec``; :class:`InvalidGrammar` when its source does not parse."""
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_STYLE)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            options = json.loads(spec.source)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        if spec.kind == "grammar" and "::=" in spec.source:
            return llguidance.grammar_from("gbnf", spec.source)
        if spec.kind in ("grammar", "lark"):
            return llguidance.LLMatcher.grammar_from_lark(spec.source)
    except (ValueError, TypeError) as e:
        raise InvalidGrammar(_tidy(str(e))) from None
    raise InvalidGrammar(f"unknown constraint kind {spec.kind!r}")


def _tidy(message: str) -> str:
    """llguidance's message without its internal position prefixes, on one line."""
    return re.sub(r"\s+", " ", message).strip()
