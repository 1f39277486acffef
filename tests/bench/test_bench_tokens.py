"""Prompt sizing agrees with the server's tokenizer, whichever /tokenize dialect it speaks."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fleetllm.bench.tokens import TokenCounter


def _fake_post(answer: Any) -> Any:
    def post(url: str, json: dict[str, Any], timeout: float) -> httpx.Response:
        return httpx.Response(200, json=answer(json), request=httpx.Request("POST", url))

    return post


def test_vllm_style_count_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpx, "post", _fake_post(lambda body: {"tokens": [1] * 7, "count": 7}))
    assert TokenCounter("http://x", "m").count("three words here") == 7


def test_llama_server_content_dialect_is_tried_when_prompt_gives_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # llama-server reads only "content" and answers {"tokens": []} to a "prompt" body.
    monkeypatch.setattr(httpx, "post", _fake_post(lambda body: {"tokens": [5, 6, 7, 8] if "content" in body else []}))
    counter = TokenCounter("http://x", "m")
    assert counter.count("two words") == 4
    assert counter.server_side is True


def test_no_tokenize_endpoint_falls_back_to_words(monkeypatch: pytest.MonkeyPatch) -> None:
    def post(url: str, json: dict[str, Any], timeout: float) -> httpx.Response:
        return httpx.Response(404, json={}, request=httpx.Request("POST", url))

    monkeypatch.setattr(httpx, "post", post)
    counter = TokenCounter("http://x", "m")
    assert counter.count("one two three") == 3
    assert counter.server_side is False
