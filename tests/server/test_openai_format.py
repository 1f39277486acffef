"""OpenAI response objects and SSE chunks, built from engine outputs without a server."""

from __future__ import annotations

import json

import pytest

from fleetllm.engine.outputs import RequestOutput, TokenLogprob
from fleetllm.server import openai_format as fmt
from fleetllm.server.protocol import APIError

VOCAB = {1: "Hi", 2: " there", 3: "é"}


def text_of(token_id: int) -> str:
    return VOCAB[token_id]


def out(text: str = "", finished: bool = False, finish_reason: str | None = None, prompt: int = 5, output: int = 1,
        cached: int = 0, logprobs: list[TokenLogprob] | None = None, error: str | None = None,
        stop_reason: str | int | None = None) -> RequestOutput:
    return RequestOutput("r", [], text, finished, prompt, output, cached, finish_reason, stop_reason, logprobs, error)


def test_usage_totals_prompt_and_completion_and_reports_cached_tokens() -> None:
    assert fmt.usage(7, 3, 4) == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                  "prompt_tokens_details": {"cached_tokens": 4}}


def test_total_usage_counts_each_prompt_once_and_every_choices_output() -> None:
    # two prompts, n=2: choices 0,1 share prompt 0 and choices 2,3 share prompt 1
    counts = {0: (10, 3, 8), 1: (10, 4, 8), 2: (6, 1, 0), 3: (6, 2, 0)}
    assert fmt.total_usage(counts, n=2) == fmt.usage(16, 10, 8)


@pytest.mark.parametrize(("reason", "expected"), [("stop", "stop"), ("length", "length"), ("abort", "abort"),
                                                  ("error", "error"), (None, None)])
def test_finish_reason_names_why_the_choice_ended(reason: str | None, expected: str | None) -> None:
    assert fmt.finish_reason(out(finished=True, finish_reason=reason)) == expected


def test_chat_logprobs_give_each_token_its_bytes_and_alternatives() -> None:
    lp = [TokenLogprob(3, -0.5, [(3, -0.5), (1, -1.5)])]
    assert fmt.chat_logprobs(out("é", logprobs=lp), text_of) == {"content": [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [
            {"token": "é", "logprob": -0.5, "bytes": [195, 169]}, {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]}]}]}


def test_logprobs_are_none_for_an_output_without_them() -> None:
    assert fmt.chat_logprobs(out("Hi"), text_of) is None
    assert fmt.text_logprobs(out("Hi"), text_of) is None


def test_text_logprobs_list_tokens_logprobs_alternatives_and_offsets() -> None:
    lp = [TokenLogprob(1, -0.1, [(1, -0.1)]), TokenLogprob(2, -0.2, [(2, -0.2), (1, -3.0)])]
    assert fmt.text_logprobs(out("Hi there", logprobs=lp), text_of, offset=4) == {
        "tokens": ["Hi", " there"], "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"Hi": -0.1}, {" there": -0.2, "Hi": -3.0}], "text_offset": [4, 4]}


def test_a_chat_response_joins_each_choices_text_in_arrival_order() -> None:
    outs = [(1, out("Hi")), (0, out("Hi")), (0, out(" there", True, "stop", output=2)), (1, out("!", True, "length", output=2))]
    r = fmt.completion_response("chat", "chatcmpl-x", "m", 123, outs, num_choices=2, n=2, token_text=text_of)
    assert r == {"id": "chatcmpl-x", "object": "chat.completion", "created": 123, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hi there"}, "logprobs": None,
         "finish_reason": "stop", "stop_reason": None},
        {"index": 1, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None,
         "finish_reason": "length", "stop_reason": None}], "usage": fmt.usage(5, 4, 0)}


def test_a_chat_response_concatenates_the_logprobs_of_every_output() -> None:
    outs = [(0, out("Hi", logprobs=[TokenLogprob(1, -0.1)])),
            (0, out(" there", True, "stop", logprobs=[TokenLogprob(2, -0.2)]))]
    r = fmt.completion_response("chat", "c", "m", 0, outs, 1, 1, text_of)
    assert [c["token"] for c in r["choices"][0]["logprobs"]["content"]] == ["Hi", " there"]


def test_a_completions_response_merges_logprobs_without_offsets() -> None:
    outs = [(0, out("Hi", logprobs=[TokenLogprob(1, -0.1)])),
            (0, out(" there", True, "stop", stop_reason=7, logprobs=[TokenLogprob(2, -0.2)]))]
    r = fmt.completion_response("text", "cmpl-x", "m", 0, outs, 1, 1, text_of)
    assert r["object"] == "text_completion"
    assert r["choices"] == [{"index": 0, "text": "Hi there", "finish_reason": "stop", "stop_reason": 7, "logprobs": {
        "tokens": ["Hi", " there"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{}, {}]}}]


def test_an_engine_error_in_a_whole_response_is_a_500() -> None:
    with pytest.raises(APIError) as e:
        fmt.completion_response("text", "c", "m", 0, [(0, out(error="boom"))], 1, 1, text_of)
    assert e.value.status == 500 and e.value.message == "boom"


def test_a_chat_stream_opens_each_choice_with_the_assistant_role() -> None:
    assert fmt.stream_choices("chat", 1, out("Hi"), True, text_of) == [
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]


def test_a_chat_stream_ends_a_choice_with_an_empty_delta_and_its_finish_reason() -> None:
    assert fmt.stream_choices("chat", 0, out("", True, "length"), False, text_of) == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None}]


def test_an_output_with_nothing_new_streams_no_chunk() -> None:
    assert fmt.stream_choices("chat", 0, out(""), False, text_of) == []
    assert fmt.stream_choices("text", 0, out(""), False, text_of) == []


def test_a_token_whose_text_is_held_back_streams_an_empty_choice_when_every_token_streams() -> None:
    held = RequestOutput("r", [226], "", False, 5, 1, 0)  # the first byte of a three-byte character
    assert fmt.stream_choices("text", 0, held, True, text_of) == []
    assert fmt.stream_choices("text", 0, held, True, text_of, every_token=True) == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None}]
    assert fmt.stream_choices("chat", 0, held, False, text_of, every_token=True) == [
        {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}]
    assert len(fmt.stream_choices("chat", 0, held, True, text_of, every_token=True)) == 1  # the role chunk only
    assert fmt.stream_choices("text", 0, out(""), False, text_of, every_token=True) == []  # no token: no chunk


def test_a_completions_stream_carries_the_finish_reason_on_the_last_text_chunk() -> None:
    assert fmt.stream_choices("text", 2, out("!", True, "stop", stop_reason="\n"), True, text_of) == [
        {"index": 2, "text": "!", "logprobs": None, "finish_reason": "stop", "stop_reason": "\n"}]


def test_a_chunk_event_is_one_sse_data_line_with_utf8_text() -> None:
    choice = {"index": 0, "delta": {"content": "é"}, "logprobs": None, "finish_reason": None}
    line = fmt.chunk_event("chat", "chatcmpl-x", "m", 9, [choice])
    assert line == ('data: {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 9, "model": "m", '
                    '"choices": [{"index": 0, "delta": {"content": "é"}, "logprobs": null, "finish_reason": null}]}\n\n')


def test_the_usage_chunk_has_no_choices_and_the_usage() -> None:
    line = fmt.chunk_event("text", "cmpl-x", "m", 9, [], fmt.usage(1, 2, 0))
    obj = json.loads(line.removeprefix("data: "))
    assert obj["object"] == "text_completion" and obj["choices"] == [] and obj["usage"]["total_tokens"] == 3


def test_an_error_event_carries_an_openai_error_body() -> None:
    assert fmt.error_event("é failed") == ('data: {"error": {"message": "\\u00e9 failed", "type": '
                                           '"internal_server_error", "param": null, "code": 500}}\n\n')
    assert fmt.SSE_DONE == "data: [DONE]\n\n"
