"""The tool-call parsers, grammars and the streaming rewrite as pure functions (no server)."""

from __future__ import annotations

import json

from fleetllm.tools.parsers import HermesParser, Llama3JsonParser, parser_for
from fleetllm.tools.stream import ToolStream, rewrite_message
from fleetllm.tools.template import render_hermes

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def test_hermes_extracts_calls_and_keeps_the_text_around_them():
    content, calls = HermesParser().extract("Let me check.\n" + CALL + "\n" + CALL.replace('"f"', '"g"'))
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {"x": 1})]


def test_hermes_leaves_text_without_a_complete_call_as_content():
    assert HermesParser().extract("<tool_call>\n{\"name\": ") == ("<tool_call>\n{\"name\": ", [])


def test_llama3_json_reads_python_tag_calls_separated_by_semicolons():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    content, calls = Llama3JsonParser().extract(text)
    assert content is None and [c.name for c in calls] == ["f", "g"]


def test_auto_picks_the_parser_from_the_chat_template():
    assert parser_for("auto", "<|im_start|>{{ m }}").name == "hermes"
    assert parser_for("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"


def _stream(pieces: list[str]) -> list[dict]:
    ts = ToolStream(HermesParser())
    out = []
    for p in pieces:
        out += ts.rewrite({"index": 0, "delta": {"content": p}, "logprobs": None, "finish_reason": None})
    out += ts.rewrite({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"})
    return out


def test_a_streamed_call_split_anywhere_becomes_delta_tool_calls():
    text = "Sure. " + CALL
    for cut in range(1, len(text)):
        out = _stream([text[:cut], text[cut:]])
        content = "".join(c["delta"].get("content", "") for c in out)
        calls = [d for c in out for d in c["delta"].get("tool_calls", [])]
        assert content == "Sure. ", cut
        assert calls[0]["function"]["name"] == "f" and json.loads(calls[1]["function"]["arguments"]) == {"x": 1}
        assert out[-1]["finish_reason"] == "tool_calls"


def test_text_that_only_looks_like_a_tag_start_is_released():
    out = _stream(["a <tool", "box> b"])
    assert "".join(c["delta"].get("content", "") for c in out) == "a <toolbox> b"
    assert out[-1]["finish_reason"] == "stop"


def test_a_whole_message_gets_tool_calls_and_finish_reason():
    choice = {"index": 0, "message": {"role": "assistant", "content": CALL}, "finish_reason": "stop"}
    out = rewrite_message(choice, HermesParser())
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    assert out["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_the_hermes_template_renders_tools_calls_and_results():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "1", "content": "42"}]
    text = render_hermes(messages, [{"type": "function", "function": {"name": "f"}}], True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and '<tools>\n{"name": "f"}\n</tools>' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n42\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
