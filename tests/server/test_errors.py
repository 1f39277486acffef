"""Every failure the worker answers is an OpenAI-style JSON error with the right status, and the worker
keeps serving afterwards.

The worker here is deliberately small: a 128-token context, one running sequence and one waiting slot,
so "prompt too long" and "queue full" are easy to reach.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def small_worker(worker_factory: Any) -> Any:
    return worker_factory("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1", "--max-waiting", "1")


@pytest.fixture(autouse=True)
def still_serving(small_worker: Any) -> Any:
    """After every test the worker still answers a normal request."""
    yield
    r = httpx.post(small_worker.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(small_worker.base_url + "/health").status_code == 200


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param
    return err


def post(worker: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(worker.base_url + path, json=body, timeout=60)


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("top_k", -2),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("logprobs", 50),
    ],
)
def test_out_of_range_parameter_is_400_naming_it(small_worker: Any, field: str, value: Any) -> None:
    err = assert_openai_error(post(small_worker, "/v1/completions", {**COMPLETION, field: value}), 400, field)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("max_tokens", "5"),
        ("max_tokens", 2.5),
        ("n", True),
        ("seed", "abc"),
        ("top_p", [1]),
    ],
)
def test_wrongly_typed_parameter_is_400_naming_it(small_worker: Any, field: str, value: Any) -> None:
    assert_openai_error(post(small_worker, "/v1/completions", {**COMPLETION, field: value}), 400, field)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1), ("max_completion_tokens", "x"), ("max_completion_tokens", 0), ("top_logprobs", "2")],
)
def test_bad_chat_parameter_is_400_naming_it(small_worker: Any, field: str, value: Any) -> None:
    body = {**CHAT, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    assert_openai_error(post(small_worker, "/v1/chat/completions", body), 400, field)


def test_invalid_parameter_on_a_stream_is_a_json_error_not_a_stream(small_worker: Any) -> None:
    r = post(small_worker, "/v1/chat/completions", {**CHAT, "stream": True, "temperature": -1})
    assert_openai_error(r, 400, "temperature")


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": "hi"}, {"messages": [{"content": "no role"}]},
                                  {"messages": [{"role": "user", "content": 5}]}])
def test_malformed_messages_are_400(small_worker: Any, body: dict[str, Any]) -> None:
    assert_openai_error(post(small_worker, "/v1/chat/completions", body), 400, "messages")


@pytest.mark.parametrize("prompt", [5, [], None, [1.5], ["a", 1]])
def test_malformed_prompt_is_400(small_worker: Any, prompt: Any) -> None:
    assert_openai_error(post(small_worker, "/v1/completions", {"prompt": prompt}), 400, "prompt")


def test_stop_of_the_wrong_type_is_400(small_worker: Any) -> None:
    assert_openai_error(post(small_worker, "/v1/completions", {**COMPLETION, "stop": 5}), 400, "stop")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_json_is_400(small_worker: Any, path: str) -> None:
    r = httpx.post(small_worker.base_url + path, content=b'{"prompt": "Hi",', headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_a_json_body_that_is_not_an_object_is_400(small_worker: Any) -> None:
    assert_openai_error(post(small_worker, "/v1/completions", ["Hi"]), 400)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(small_worker: Any, path: str) -> None:
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), "model": "no-such-model"}
    err = assert_openai_error(post(small_worker, path, body), 404, "model")
    assert "no-such-model" in err["message"]


def test_prompt_longer_than_the_context_is_400(small_worker: Any) -> None:
    r = post(small_worker, "/v1/completions", {"prompt": list(range(100, 100 + MAX_MODEL_LEN)), "max_tokens": 1})
    err = assert_openai_error(r, 400)
    assert str(MAX_MODEL_LEN) in err["message"]


def test_prompt_plus_max_tokens_beyond_the_context_is_400(small_worker: Any) -> None:
    r = post(small_worker, "/v1/completions", {"prompt": list(range(100, 140)), "max_tokens": MAX_MODEL_LEN - 20})
    assert_openai_error(r, 400)


def test_chat_longer_than_the_context_is_400(small_worker: Any) -> None:
    r = post(small_worker, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]})
    assert_openai_error(r, 400)


def test_out_of_vocabulary_token_ids_are_400(small_worker: Any) -> None:
    assert_openai_error(post(small_worker, "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 1}), 400, "prompt")
    assert_openai_error(post(small_worker, "/detokenize", {"tokens": [10**9]}), 400, "tokens")


def test_detokenize_without_a_token_list_is_400(small_worker: Any) -> None:
    assert_openai_error(post(small_worker, "/detokenize", {"tokens": "abc"}), 400, "tokens")


def test_tokenize_without_prompt_or_messages_is_400(small_worker: Any) -> None:
    assert_openai_error(post(small_worker, "/tokenize", {}), 400, "prompt")


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing"), ("POST", "/v2/completions"),
                                              ("GET", "/v1/completions"), ("DELETE", "/v1/models")])
def test_unknown_route_is_404(small_worker: Any, method: str, path: str) -> None:
    assert_openai_error(httpx.request(method, small_worker.base_url + path), 404)


def test_a_full_queue_answers_503_and_recovers(small_worker: Any) -> None:
    base = small_worker.base_url
    small_worker.wait_idle()
    long_run = {"prompt": "Tell me a story.", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", base + "/v1/completions", json=long_run) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # keep a reference: a collected iterator closes the response
        next(lines)  # the one sequence slot is now taken
        waiting_result: dict[str, httpx.Response] = {}
        waiter = threading.Thread(target=lambda: waiting_result.update(r=post(small_worker, "/v1/completions", COMPLETION)))
        waiter.start()
        small_worker.wait_for_metrics(lambda m: m["vllm:num_requests_waiting"] == 1)  # the one queue slot too
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", {**CHAT, "stream": True})):
            err = assert_openai_error(post(small_worker, path, body), 503)
            assert err["type"] == "service_unavailable"
    # closing the running stream aborts it; the waiting request then runs to completion
    waiter.join(timeout=60)
    assert waiting_result["r"].status_code == 200
    small_worker.wait_idle()
