"""Tool calling through the official openai client: tool_choice required and named (enforced by the
tool-call grammar), tool_calls streamed and not, and a full round trip through a tool message."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "description": "Current time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"weather": WEATHER, "clock": TIME}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul", "Dakar"]
ASKS = ["What's the weather in {}?", "Is it cold in {}?", "What time is it in {}?", "Should I take an umbrella in {}?",
        "Tell me the temperature of {} in fahrenheit."]
PROMPTS = [a.format(c) for a in ASKS for c in CITIES]  # 50 varied prompts


@pytest.fixture(scope="module")
def client(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.openai_base_url, api_key="x", max_retries=0)


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_gives_valid_calls_on_50_prompts(client):
    def ask(i_prompt):
        i, prompt = i_prompt
        return client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                              tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                              max_tokens=48, temperature=0.8, seed=i)
    # one first, so the rest find the tool schemas' prompt prefix cached; then all at once, in one batch
    responses = [ask((0, PROMPTS[0]))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses += pool.map(ask, list(enumerate(PROMPTS))[1:])
    for r in responses:
        choice = r.choices[0]
        assert choice.message.tool_calls, choice
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls[0])


def test_a_named_function_is_called_and_streamed_as_delta_tool_calls(client):
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Oslo please"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "clock"}}, max_tokens=40, stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and len(calls) == 1
    assert calls[0]["name"] == "clock" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)


def test_a_tool_round_trip_ends_in_an_answer(client):
    messages = [{"role": "user", "content": "What's the weather in Rome?"}]
    first = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    call = first.choices[0].message.tool_calls[0]
    calls = [c.model_dump() for c in first.choices[0].message.tool_calls]
    messages += [{"role": "assistant", "content": None, "tool_calls": calls},  # no text: SmolLM2's template fails
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    answer = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=12)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_fields_are_a_400_naming_them(client, fields, param):
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param
