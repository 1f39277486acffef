"""POST /v1/messages through the official anthropic client: text and a tool round trip, streamed and not;
the router forwarding /v1/messages and /v1/responses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jsonschema
import pytest
from fleet_helpers import router, wait_state

if TYPE_CHECKING:
    import anthropic as anthropic_sdk

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "weather", "description": "Current weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def client(worker, anthropic) -> anthropic_sdk.Anthropic:
    return anthropic.Anthropic(base_url=worker.url, api_key="x", max_retries=0)


def test_a_text_answer(client):
    msg = client.messages.create(model="smollm2-135m", max_tokens=8, system="Be brief.",
                                 messages=[{"role": "user", "content": "Say hello"}])
    assert msg.role == "assistant" and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens > 0


def test_a_streamed_text_answer_matches_the_whole_one(client):
    kw = dict(model="smollm2-135m", max_tokens=8, extra_body={"temperature": 0.0},
              messages=[{"role": "user", "content": "Count: 1 2 3"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.stop_reason == whole.stop_reason


def test_a_tool_round_trip_streamed_and_not(client):
    messages = [{"role": "user", "content": "What's the weather in Lima?"}]
    kw = dict(model="smollm2-135m", max_tokens=40, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    msg = client.messages.create(messages=messages, **kw)
    with client.messages.stream(messages=messages, **kw) as stream:
        streamed = stream.get_final_message()
    for m in (msg, streamed):
        [use] = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and use.name == "weather" and use.id
        jsonschema.validate(use.input, WEATHER)
    use = next(b for b in msg.content if b.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C, sunny"}]}]
    answer = client.messages.create(model="smollm2-135m", max_tokens=10, tools=TOOLS, messages=messages)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_missing_max_tokens_is_a_400(client, anthropic):
    with pytest.raises(anthropic.BadRequestError):
        client.post("/v1/messages", body={"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}]},
                    cast_to=object)


def test_the_router_serves_messages_and_responses_from_its_worker(worker, procs, anthropic):
    import openai

    r = router([worker.url], "kv_aware")
    procs.append(r)
    wait_state(r.url, lambda s: any(w["healthy"] for w in s["workers"]))
    msg = anthropic.Anthropic(base_url=r.url, api_key="x", max_retries=0).messages.create(
        model="smollm2-135m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert msg.content[0].text
    resp = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0).responses.create(
        model="smollm2-135m", input="Hi", max_output_tokens=4)
    assert resp.output_text
