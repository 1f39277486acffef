"""A worker started with ``--speculative`` streams the same greedy text as it returns whole, honours
stop strings and max_tokens, and exports the vLLM speculative-decoding counters."""

from __future__ import annotations

from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow  # a second engine with speculation (the fast tier checks speculation in-process)

COPY = "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa. alpha beta gamma delta"


@pytest.fixture(scope="module")
def spec_worker(worker_factory: Any) -> Any:
    return worker_factory("--speculative", "method=ngram,k=4,adaptive=0", "--num-threads", "1")


@pytest.fixture(scope="module")
def client(spec_worker: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=spec_worker.openai_base_url, api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    return client.completions.create(model="smollm2-135m", prompt=COPY, temperature=0, **kw)


def test_streamed_text_equals_the_whole_answer(client: openai.OpenAI) -> None:
    whole = complete(client, max_tokens=24).choices[0].text
    chunks = complete(client, max_tokens=24, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole


def test_max_tokens_is_never_overshot(client: openai.OpenAI) -> None:
    res = complete(client, max_tokens=5)
    assert res.usage.completion_tokens == 5
    assert res.choices[0].finish_reason == "length"


def test_a_stop_string_cuts_a_multi_token_step(client: openai.OpenAI) -> None:
    whole = complete(client, max_tokens=24).choices[0].text
    stop = whole.split()[3]
    res = complete(client, max_tokens=24, stop=[stop])
    assert res.choices[0].finish_reason == "stop"
    assert res.choices[0].text == whole[: whole.index(stop)]


def test_spec_decode_counters_are_exported(client: openai.OpenAI, spec_worker: Any) -> None:
    complete(client, max_tokens=16)
    m = spec_worker.wait_idle()
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    assert m["vllm:spec_decode_num_draft_tokens_total"] >= m["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == m["vllm:spec_decode_num_accepted_tokens_total"]
