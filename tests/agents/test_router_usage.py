"""The router counts the tokens of Messages and Responses answers (key quotas), streamed and not."""

from __future__ import annotations

import json

from fleetllm.router.forward import TokenCount


def test_a_messages_answer_counts_cache_reads_as_prompt_tokens():
    body = {"usage": {"input_tokens": 4, "cache_read_input_tokens": 16, "output_tokens": 7}}
    t = TokenCount.of_body(json.dumps(body).encode())
    assert (t.prompt, t.completion) == (20, 7)


def test_a_messages_stream_is_counted_from_its_events():
    t = TokenCount()
    for kind, data in [("message_start", {"message": {"usage": {"input_tokens": 20, "output_tokens": 0}}}),
                       ("content_block_delta", {"delta": {"type": "text_delta", "text": "hi"}}),
                       ("message_delta", {"usage": {"input_tokens": 4, "cache_read_input_tokens": 16,
                                                    "output_tokens": 9}})]:
        t.feed(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode())
    assert (t.prompt, t.completion) == (20, 9)


def test_a_responses_stream_is_counted_from_response_completed():
    t = TokenCount()
    done = {"type": "response.completed", "response": {"usage": {"input_tokens": 30, "output_tokens": 5}}}
    t.feed(f"data: {json.dumps({'type': 'response.created', 'response': {'usage': None}})}\n\n".encode())
    t.feed(f"data: {json.dumps(done)}\n\n".encode())
    assert (t.prompt, t.completion) == (30, 5)
