"""Hostile and careless input: every bad request is an OpenAI-style 4xx naming what is wrong, never a 5xx,
never silently ignored; a request's deadline is enforced and frees its KV blocks."""

from __future__ import annotations

import time

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"prompt": "Hi", "max_tokens": 2}

BAD = [  # (path, body, the field the 400 must name)
    ("/v1/completions", {**TEXT, "seed": 2**70}, "seed"),
    ("/v1/completions", {**TEXT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {**TEXT, "logit_bias": {"-5": 1}}, "logit_bias"),
    ("/v1/completions", {**TEXT, "logit_bias": {"5": "NaN"}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("/v1/completions", {**TEXT, "best_of": 3}, "best_of"),
    ("/v1/completions", {**TEXT, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {}}]}, "tools"),  # no name
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),  # legacy: not implemented
    ("/v1/completions", {**TEXT, "stop": [f"s{i}" for i in range(5000)]}, "stop"),
    ("/v1/completions", {**TEXT, "stream": True, "stream_options": "yes"}, "stream_options"),
    ("/v1/completions", {**TEXT, "timeout": -1}, "timeout"),
    ("/v1/completions", {**TEXT, "n": 10**6}, "n"),
    ("/v1/completions", {**TEXT, "max_tokens": 10**12}, "max_tokens"),
]


def _is_openai_error(r: httpx.Response) -> bool:
    err = r.json().get("error")
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_parameter_is_a_400_naming_it(sim, path: str, body: dict, field: str) -> None:
    r = httpx.post(sim.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert _is_openai_error(r) and r.json()["error"]["param"] == field, r.text


def test_the_router_answers_the_same_400s(sim_router) -> None:
    for path, body, field in BAD[:6]:
        r = httpx.post(sim_router.url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("server", ["sim", "sim_router"])
def test_malformed_bodies_are_4xx(server: str, request) -> None:
    url = request.getfixturevalue(server).url + "/v1/completions"
    big = httpx.post(url, content=b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}', timeout=60)
    assert big.status_code == 413 and _is_openai_error(big)
    deep = httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000, timeout=30)
    assert deep.status_code == 400 and _is_openai_error(deep)
    utf8 = httpx.post(url, content=b'{"prompt": "\xff\xfe"}', timeout=30)
    assert utf8.status_code == 400 and _is_openai_error(utf8)


def _kv_idle(url: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln.startswith(("vllm:kv_cache_usage_perc", "vllm:num_requests_running"))}
    return values["vllm:kv_cache_usage_perc"] == 0 and values["vllm:num_requests_running"] == 0


def _wait_idle(url: str) -> None:
    end = time.monotonic() + 20
    while not _kv_idle(url):
        assert time.monotonic() < end, "the timed-out request still holds KV blocks"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["body", "header"])
def test_a_request_past_its_deadline_is_aborted_and_frees_its_blocks(sim, sim_router, how: str) -> None:
    body = {"prompt": "Count:", "max_tokens": 4000, "ignore_eos": True}
    kw = {"json": {**body, "timeout": 0.3}} if how == "body" else {"json": body, "headers": {"x-request-timeout": "0.3"}}
    r = httpx.post(sim_router.url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == 408 and r.json()["error"]["param"] == "timeout", r.text
    _wait_idle(sim.url)
    with httpx.stream("POST", sim.url + "/v1/completions", timeout=30,
                      **{**kw, "json": {**kw["json"], "stream": True}}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"code": 408' in lines[-2]
    _wait_idle(sim.url)


@pytest.mark.parametrize("server", ["sim", "sim_router"])
def test_the_openapi_schema_is_published(server: str, request) -> None:
    doc = httpx.get(request.getfixturevalue(server).url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.") and {"/v1/chat/completions", "/v1/completions"} <= doc["paths"].keys()
