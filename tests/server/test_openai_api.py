"""The worker speaks the OpenAI API: the official ``openai`` client works unchanged against it, and the
side endpoints (/v1/models, /tokenize, /detokenize, /health, /metrics) answer as vLLM's do."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest

MAX_TOKENS = 6
# Long enough (> 2 blocks of 16 tokens) that a repeat is a prefix-cache hit.
LONG_PROMPT = (
    "Once upon a time there was a little fox who lived in a forest near a wide river. "
    "Every morning the fox walked to the water to watch the boats go by and count the birds."
)


@pytest.fixture(scope="module")
def client(worker: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.openai_base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_messages(text: str = "Say hello.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- chat -----------------------------------------------------------------------------------------
def test_chat_completion_returns_an_assistant_message_with_usage(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=chat_messages(), max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion"
    assert r.model == model
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_concatenates_to_the_non_streaming_answer(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "messages": chat_messages(), "max_tokens": MAX_TOKENS, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks)  # no usage unless asked for


def test_chat_stream_with_include_usage_ends_with_a_usage_chunk(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(
        model=model, messages=chat_messages(), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens > 0
    assert 0 < last.usage.completion_tokens <= MAX_TOKENS
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_with_n_returns_n_choices(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=chat_messages(), max_tokens=3, temperature=1.0, seed=1, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage is not None
    assert 2 <= r.usage.completion_tokens <= 2 * 3  # summed over the choices


def test_chat_logprobs_report_the_requested_number_of_alternatives(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=chat_messages(), max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert content is not None and 1 <= len(content) <= 3
    for tok in content:
        assert tok.logprob <= 0
        assert len(tok.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-4)


# ---- completions -----------------------------------------------------------------------------------
def test_completion_returns_text_with_usage(client: openai.OpenAI, model: str, worker: Any) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion"
    (choice,) = r.choices
    assert choice.text
    assert r.usage is not None
    assert r.usage.prompt_tokens == httpx.post(worker.base_url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert r.usage.completion_tokens == MAX_TOKENS or choice.finish_reason == "stop"


def test_completion_stream_concatenates_to_the_non_streaming_text(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "prompt": "The capital of France is", "max_tokens": MAX_TOKENS,
                              "temperature": 0}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_a_completion_stream_sends_a_chunk_for_every_token_even_while_its_text_is_held_back(
        client: openai.OpenAI, model: str) -> None:
    # greedy, this prompt's first token is the first byte of a Japanese character: its text waits for the next
    kwargs: dict[str, Any] = {"model": model, "prompt": "Translate to Japanese: thank you ->", "max_tokens": 4,
                              "temperature": 0}
    full = client.completions.create(**kwargs)
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert len(chunks) == full.usage.completion_tokens == 4
    assert chunks[0].choices[0].text == "" and chunks[1].choices[0].text != ""
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_completion_stream_with_include_usage_ends_with_a_usage_chunk(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert 0 < chunks[-1].usage.completion_tokens <= MAX_TOKENS


def test_completion_accepts_token_id_prompts(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage is not None and r.usage.prompt_tokens == 5


def test_a_stop_string_ends_the_completion_with_finish_reason_stop(client: openai.OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    text = free.choices[0].text
    assert len(text.strip()) > 1
    stop = text.strip()[1]  # a character the greedy answer is known to produce after its first
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    assert stop not in r.choices[0].text


# ---- prefix caching ---------------------------------------------------------------------------------
def test_a_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    first = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 16
    second = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < second.usage.prompt_tokens  # capped below the prompt length
    assert cached % 16 == 0  # whole blocks


def test_a_repeated_chat_reports_cached_tokens_in_the_streamed_usage(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "messages": chat_messages(LONG_PROMPT), "max_tokens": 2, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True}}
    list(client.chat.completions.create(**kwargs))
    usage = list(client.chat.completions.create(**kwargs))[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens and usage.prompt_tokens_details.cached_tokens > 0


# ---- side endpoints ---------------------------------------------------------------------------------
def test_models_lists_the_served_model(client: openai.OpenAI, worker: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m"]
    assert models[0].object == "model"


def test_tokenize_and_detokenize_round_trip(worker: Any) -> None:
    text = "Hello, world! How are you?"
    r = httpx.post(worker.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] > 0
    back = httpx.post(worker.base_url + "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200
    assert back.json()["prompt"] == text


def test_tokenize_messages_applies_the_chat_template(worker: Any) -> None:
    r = httpx.post(worker.base_url + "/tokenize", json={"messages": chat_messages("hi")})
    plain = httpx.post(worker.base_url + "/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    assert r.status_code == 200
    assert r.json()["count"] > plain.json()["count"]


def test_health_is_ok(worker: Any) -> None:
    r = httpx.get(worker.base_url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


VLLM_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
]


def test_metrics_exposes_the_vllm_names(worker: Any) -> None:
    r = httpx.get(worker.base_url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    m = worker.metrics()
    for name in VLLM_METRICS:
        assert name in m, name
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert re.search(rf'^vllm:{hist}_bucket{{[^}}]*le="\+Inf",model_name="smollm2-135m",', r.text, re.M), hist


def test_metric_counters_equal_the_requests_and_tokens_sent(client: openai.OpenAI, model: str, worker: Any) -> None:
    before = worker.wait_idle()
    prompts = ["Count to three:", "Name a color:", LONG_PROMPT, LONG_PROMPT]
    usages = []
    for p in prompts:  # one at a time, so no request can be preempted and re-admitted
        r = client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0)
        assert r.usage is not None
        usages.append(r.usage)
    after = worker.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before[name]

    n = len(prompts)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    completion_tokens = sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens or 0 for u in usages if u.prompt_tokens_details)
    assert cached > 0  # the repeated LONG_PROMPT
    assert delta("vllm:request_success_total") == n
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == completion_tokens
    assert delta("vllm:prefix_cache_queries_total") == prompt_tokens
    assert delta("vllm:prefix_cache_hits_total") == cached
    assert delta("vllm:time_to_first_token_seconds_count") == n
    assert delta("vllm:e2e_request_latency_seconds_count") == n
    assert delta("vllm:inter_token_latency_seconds_count") == completion_tokens - n


def test_gauges_return_to_zero_when_idle(worker: Any) -> None:
    m = worker.wait_idle()
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
