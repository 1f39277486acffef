"""POST /v1/responses through the official openai client: text, function calls, previous_response_id,
text.format json_schema, streaming events."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "weather", "description": "Current weather in a city", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.openai_base_url, api_key="x", max_retries=0)


def test_a_text_response(client):
    r = client.responses.create(model="smollm2-135m", input="Say hello", instructions="Be brief.", max_output_tokens=8)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens > 0


def test_a_function_call_then_its_output_through_previous_response_id(client):
    first = client.responses.create(model="smollm2-135m", input="What's the weather in Oslo?", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=40)
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    second = client.responses.create(model="smollm2-135m", previous_response_id=first.id, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21C"}])
    assert second.output_text and second.usage.input_tokens_details.cached_tokens > 0  # the turn reused the KV


def test_text_format_json_schema_and_streaming_events(client):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}}
    events = list(client.responses.create(model="smollm2-135m", input="A city as JSON", text=fmt,
                                          max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), WEATHER)
    assert events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_an_unknown_previous_response_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2-135m", input="hi", previous_response_id="resp_nope", max_output_tokens=4)
