"""The OpenAPI 3 document of the serving API (``GET /openapi.json``), shared by the worker and the router.

Written out by hand, like the parsing it describes (:mod:`.protocol`): the request fields fleetllm
reads, with their types, and the OpenAI-style error every rejection carries. Fuzzers and client
generators read it; the parser, not this document, is what enforces it.
"""

from __future__ import annotations

from typing import Any

from fleetllm.engine.params import MAX_STOP_TOKEN_IDS
from fleetllm.server.limits import MAX_MESSAGES, MAX_PROMPTS

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}

_SAMPLING = {
    "model": _STR, "max_tokens": {**_INT, "minimum": 1}, "temperature": {**_NUM, "minimum": 0, "maximum": 100},
    "top_p": {**_NUM, "minimum": 0, "exclusiveMinimum": True, "maximum": 1}, "top_k": {**_INT, "minimum": -1, "description": "-1 or 0: off; at most the vocabulary's size"},
    "min_p": {**_NUM, "minimum": 0, "maximum": 1}, "n": {**_INT, "minimum": 1, "maximum": 16},
    "seed": {**_INT, "minimum": -(2**63), "maximum": 2**63 - 1},
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2}, "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NUM, "minimum": 0, "exclusiveMinimum": True, "maximum": 10},
    "stop": {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 64}]},
    "stop_token_ids": {"type": "array", "items": {**_INT, "minimum": 0, "maximum": 2**31 - 1},
                       "maxItems": MAX_STOP_TOKEN_IDS}, "ignore_eos": _BOOL, "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL, "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "timeout": {**_NUM, "minimum": 0, "exclusiveMinimum": True, "description": "seconds; past it the request is aborted (408)"},
    "user": _STR, "return_token_ids": {**_BOOL, "description": "vLLM's: choices carry prompt_token_ids and token_ids"},
}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"oneOf": [_STR, {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                           "properties": {"type": {"enum": ["text"]}, "text": _STR}}}]}}}
_CHAT = {"type": "object", "required": ["messages"], "properties": {
    **_SAMPLING, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": MAX_MESSAGES},
    "max_completion_tokens": {**_INT, "minimum": 1}, "logprobs": _BOOL, "top_logprobs": {**_INT, "minimum": 0, "maximum": 20},
    "add_generation_prompt": _BOOL}}
_COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    **_SAMPLING, "logprobs": {**_INT, "minimum": 0, "maximum": 20},
    "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1, "maxItems": MAX_PROMPTS},
                         {"type": "array", "items": {**_INT, "minimum": 0}, "minItems": 1},
                         {"type": "array", "items": {"type": "array", "items": {**_INT, "minimum": 0}, "minItems": 1},
                          "minItems": 1, "maxItems": MAX_PROMPTS}]}}}
_TOKENIZE = {"type": "object", "properties": {"prompt": _STR, "add_special_tokens": _BOOL,
                                              "messages": {"type": "array", "items": _MESSAGE, "minItems": 1}}}
_DETOKENIZE = {"type": "object", "required": ["tokens"],
               "properties": {"tokens": {"type": "array", "items": {**_INT, "minimum": 0}}}}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": _STR, "type": _STR, "param": {"type": "string", "nullable": True}, "code": _INT}}}}


def _post(summary: str, body: dict[str, Any]) -> dict[str, Any]:
    error = {"description": "an OpenAI-style error", "content": {"application/json": {"schema": _ERROR}}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                     "parameters": [{"name": "x-request-timeout", "in": "header", "required": False,
                                     "schema": {**_NUM, "minimum": 0, "exclusiveMinimum": True}}],
                     "responses": {"200": {"description": "the answer (JSON, or server-sent events when stream)"},
                                   "4XX": error, "5XX": error}}}


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}


def openapi_schema(title: str, probes: tuple[str, ...]) -> dict[str, Any]:
    """The document for a server called ``title`` that also answers GET on each of ``probes``."""
    paths = {"/v1/chat/completions": _post("chat completion", _CHAT),
             "/v1/completions": _post("text completion", _COMPLETION),
             "/tokenize": _post("token ids of a prompt or chat", _TOKENIZE),
             "/detokenize": _post("text of token ids", _DETOKENIZE),
             "/v1/models": _get("the served models"),
             **{p: _get(p.strip("/")) for p in probes}}
    return {"openapi": "3.0.3", "info": {"title": title, "version": "1"}, "paths": paths}
