"""Segment-cached encoding (router and worker chats) gives exactly the tokenizer's ids, cold and warm."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer

from fleetllm.models.segments import SegmentEncoder
from fleetllm.models.source import load_tokenizer
from fleetllm.router.tokens import chat_prompt

PIECES = ["hello", " world", "  two spaces", "\n\n", "tab\there", "1234567", "ünïcödé", "日本語", "🙂", "<|im_start|>",
          "<|im_end|>", "<|im_start", "|>", "<repo_name>", "<reponame>x", " ", "", "end.", "a" * 40]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")[1]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))


def test_chats_encode_as_the_tokenizer_does(tok) -> None:
    rng = random.Random(0)
    enc = SegmentEncoder(tok.tok)
    system = {"role": "system", "content": "You are helpful. " * 20}
    for _ in range(40):
        turns = [system] + [{"role": r, "content": _text(rng)} for r in ("user", "assistant") * rng.randint(0, 3)]
        text = chat_prompt(tok, "/v1/chat/completions", {"messages": [*turns, {"role": "user", "content": _text(rng)}]})
        want = tok.encode(text, add_special_tokens=False)
        assert enc.encode(text) == want  # cold or partly cached
        assert enc.encode(text) == want  # every piece cached


def test_raw_texts_with_added_tokens_anywhere_encode_the_same(tok) -> None:
    rng = random.Random(1)
    enc = SegmentEncoder(tok.tok, max_ids=64)  # a tiny cache: evictions on the way
    for _ in range(200):
        text = _text(rng)
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), repr(text)


def test_a_tokenizer_whose_added_tokens_strip_whitespace_is_encoded_whole(tok) -> None:
    t = Tokenizer.from_str(tok.tok.to_str())
    t.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    enc = SegmentEncoder(t)
    assert enc.splitter is None
    assert enc.encode("a  <mask> b") == t.encode("a  <mask> b", add_special_tokens=False).ids
