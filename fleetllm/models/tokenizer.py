"""Tokenizer and chat template, from a HF directory (tokenizer.json) or from GGUF metadata.

The router uses this same class, so the token ids it hashes are exactly the engine's.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

if TYPE_CHECKING:
    from fleetllm.models.segments import SegmentEncoder

_SEGMENTS_LOCK = threading.Lock()

# llama.cpp's pre-tokenizer names -> the split regex that precedes byte-level BPE.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre, _GPT2_SPLIT)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_bpe(tokens: list[str], meta: dict[str, Any]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _gemma_sentencepiece(tokens: list[str]) -> Tokenizer:
    """Gemma's SentencePiece BPE (no prefix space, byte fallback) as a ``tokenizers`` BPE.

    A GGUF carries no merges for it. SentencePiece merges the adjacent pair whose result comes first in
    the vocabulary (Gemma's vocabulary is in merge order; its scores are not), so every way of splitting
    a piece into two pieces is a merge ranked by the piece's id. Ties between splits of one piece go to
    the longer left part, as in HF transformers' conversion, so both give the same ids.
    """
    # llama.cpp writes Gemma's all-whitespace pieces with real spaces; in the model's spelling a space is U+2581.
    pieces = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for piece in pieces:
        merges.extend((piece[:cut], piece[cut:]) for cut in range(len(piece) - 1, 0, -1)
                      if piece[:cut] in vocab and piece[cut:] in vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


# Gemma's own turn format, for base Gemma models whose GGUF has no chat template (the instruction-tuned
# ones ship this format in theirs). Gemma has no system role: a system message opens the first user turn.
GEMMA_TURN_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] ~ '\n\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ system if loop.first and m['role'] == 'user' else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class TokenizerWrapper:
    """Encode/decode plus chat-template rendering, with the model's special token ids."""

    def __init__(
        self,
        tok: Tokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool = False,
    ) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = add_bos
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._segments: SegmentEncoder | None = None  # made on first use of encode_pieces
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> TokenizerWrapper:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (chat template, bos/eos) from a HF directory."""
        path = Path(path)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(tok, template, _tok_str(cfg.get("bos_token")), _tok_str(cfg.get("eos_token")), cfg.get("add_bos_token", False))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> TokenizerWrapper:
        """Rebuild the tokenizer from ``tokenizer.ggml.*`` metadata: byte-level BPE, or Gemma's SentencePiece."""
        kind, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
        template = meta.get("tokenizer.chat_template")
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, meta)
        elif kind == "llama" and arch in ("gemma2", "gemma3"):  # one SentencePiece BPE for both
            tok = _gemma_sentencepiece(tokens)
            template = template or GEMMA_TURN_TEMPLATE
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} ({arch}) is not supported: byte-level BPE 'gpt2', or Gemma 2/3's")
        # Control (3) and user-defined (4) tokens match whole, never split by BPE. Gemma's runs of spaces are
        # user-defined but respelled in the vocabulary: BPE builds them from U+2581 like any other piece.
        special = [AddedToken(t, special=(ty == 3), normalized=False) for t, ty in zip(tokens, types, strict=True)
                   if ty in (3, 4) and tok.token_to_id(t) is not None]
        tok.add_tokens(special)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            tok,
            template,
            tokens[bos] if bos is not None else None,
            tokens[eos] if eos is not None else None,
            bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    # ---- use ---------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_pieces(self, text: str) -> list[int]:
        """``encode(text, add_special_tokens=False)``, remembering the pieces between added tokens: a chat
        that resends its history encodes only what is new (:mod:`fleetllm.models.segments`)."""
        with _SEGMENTS_LOCK:
            if self._segments is None:
                from fleetllm.models.segments import SegmentEncoder

                self._segments = SegmentEncoder(self.tok)
        return self._segments.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages to the prompt text the model was trained on."""
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def _raise(msg: str) -> None:
    raise ValueError(msg)


def _tok_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v
