"""OpenAI request parsing and error bodies, shared by the worker and the router.

Parsing is explicit (no schema library) so every bad field gets a precise 400 naming the parameter.
A parameter fleetllm does not implement is refused by name, never silently ignored: a client that
asks for JSON output or tool calls must learn it gets neither.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fleetllm.engine.params import PRIORITY_MAX, PRIORITY_MIN, InvalidParameter, SamplingParams
from fleetllm.server.errors import APIError
from fleetllm.server.limits import MAX_MESSAGES, check_chars, check_prompts, loads


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (APIError 400 otherwise)."""
    try:
        body = loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _num(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        try:
            v = float(v)
        except OverflowError:
            raise APIError(400, f"{key} is out of range", key) from None
    if not isinstance(v, kind) or isinstance(v, bool):
        raise APIError(400, f"{key} must be a {kind.__name__}, got {type(v).__name__}", key)
    return v


# Parameters of the OpenAI API that fleetllm does not implement, with the values that ask for nothing
# (a client library's defaults): any other value is refused with a 400 naming the parameter.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {  # tools, response_format and guided_* are implemented (fleetllm/tools,
    # fleetllm/structured): parsed in server/structured_fields.py and tools/request.py
    "functions": (None, []), "function_call": (None, "none"),
    "logit_bias": (None, {}), "best_of": (None, 1),
    "prompt_logprobs": (None,), "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,),
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TIMEOUT_S = 24 * 3600.0


def reject_unsupported(body: dict[str, Any]) -> None:
    """APIError 400 naming the first parameter fleetllm would otherwise have to ignore."""
    for name, harmless in UNSUPPORTED.items():
        if name in body and not any(body[name] == h and type(body[name]) is type(h) for h in harmless):
            raise APIError(400, f"{name} is not supported by fleetllm", name)


def request_timeout(body: Mapping[str, Any], headers: Mapping[str, str]) -> float | None:
    """The request's deadline in seconds from now: ``timeout`` in the body, else the ``x-request-timeout``
    header; None when neither is given. APIError 400 (param ``timeout``) unless a positive number."""
    value: Any = body.get("timeout")
    if value is None and headers.get("x-request-timeout") is not None:
        try:
            value = float(headers["x-request-timeout"])
        except ValueError:
            raise APIError(400, "the x-request-timeout header must be a number of seconds", "timeout") from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TIMEOUT_S:
        raise APIError(400, f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}]", "timeout")
    return float(value)


def request_priority(body: Mapping[str, Any]) -> int:
    """The request's ``priority`` (0 when absent): APIError 400 naming it unless an integer in range."""
    value = body.get("priority")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise APIError(400, f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got "
                            f"{json.dumps(value)[:40]}", "priority")
    return value


# Set by a router's flow control on a request it released as bulk work (a tenant past its weighted share of the
# batch slots): the worker serves it one priority level less urgent than it asked, so under
# --scheduling-policy priority a waiting interactive request of the same priority takes its batch slot. A client
# that sends it itself only demotes its own request.
BULK_HEADER = "x-fleetllm-bulk"


def bulk_priority(priority: int) -> int:
    """The priority a bulk request is served at: one level less urgent (at most :data:`PRIORITY_MAX`)."""
    return min(priority + 1, PRIORITY_MAX)


def sampling_from_body(body: dict[str, Any], chat: bool) -> SamplingParams:
    """Build :class:`SamplingParams` from an OpenAI request body (chat or completions)."""
    reject_unsupported(body)
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    max_tokens = _num(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is None:
        max_tokens = _num(body, "max_tokens", int, None if chat else 16)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    if chat:
        logprobs = None
        if body.get("logprobs"):
            logprobs = _num(body, "top_logprobs", int, 0)
    else:
        logprobs = _num(body, "logprobs", int, None)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(i, int) for i in stop_ids):
        raise APIError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_num(body, "temperature", float, 1.0),
            top_p=_num(body, "top_p", float, 1.0),
            top_k=_num(body, "top_k", int, -1),
            min_p=_num(body, "min_p", float, 0.0),
            seed=_num(body, "seed", int, None),
            presence_penalty=_num(body, "presence_penalty", float, 0.0),
            frequency_penalty=_num(body, "frequency_penalty", float, 0.0),
            repetition_penalty=_num(body, "repetition_penalty", float, 1.0),
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=bool(body.get("ignore_eos", False)),
            include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
            logprobs=logprobs,
            skip_special_tokens=bool(body.get("skip_special_tokens", True)),
            n=_num(body, "n", int, 1),
            priority=request_priority(body),
        )
    except InvalidParameter as e:
        param = e.param
        if param == "max_tokens" and chat and body.get("max_completion_tokens") is not None:
            param = "max_completion_tokens"  # name the field the client sent
        raise APIError(400, str(e), param) from None


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Validate ``messages`` and flatten content parts to text."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list", "messages")
    if len(msgs) > MAX_MESSAGES:
        raise APIError(400, f"{len(msgs)} messages in one request: at most {MAX_MESSAGES}", "messages")
    out, chars = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a role", "messages")
        if m["role"] not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role'][:40]!r}",
                           "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text":
                    raise APIError(400, f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(str(p.get("text", "")))
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts", "messages")
        chars += len(content)
        out.append({**m, "content": content})
    check_chars(chars, "messages")
    return out


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """``prompt`` as a list of prompts, each text or token ids."""
    p = body.get("prompt")
    if isinstance(p, str):
        check_chars(len(p), "prompt")
        return [p]
    if isinstance(p, list) and p:
        check_prompts(p if isinstance(p[0], list | str) else [p])
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [p]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p):
            return list(p)
    raise APIError(400, "prompt must be a string, a list of strings, or token ids", "prompt")
