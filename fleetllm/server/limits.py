"""What a request may carry, checked before anything is allocated for it or parsed further.

Every number in a JSON body is finite (``NaN`` and ``Infinity``, which Python's ``json`` accepts, are refused,
as is a float literal too large for a double) and every integer literal has at most :data:`MAX_INT_DIGITS`
digits (Python would parse 4,000 of them, and refuse 5,000 with an error that is no JSON error). A request's
prompts are capped in count (:data:`MAX_PROMPTS`; a chat's messages: :data:`MAX_MESSAGES`) and in characters (:data:`MAX_PROMPT_CHARS`, far above any
context a served model has), so a body under the size cap still cannot ask for millions of sub-requests or
seconds of tokenising. Torch-free: the router checks the same limits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

from fleetllm.server.errors import APIError

MAX_INT_DIGITS = 40  # 2**128 has 39 digits: no field of any API here needs more
MAX_PROMPTS = 1024  # prompts in one completions request (each is a sub-request, times n)
MAX_PROMPT_CHARS = 4 * 2**20  # characters of a request's prompts or messages, all together
MAX_MESSAGES = 16384  # messages in one chat (a template renders each: a million empty ones would take seconds)
LARGE_INPUT_CHARS = 16 * 2**10  # from here, parsing and tokenising go off the event loop (a few ms and more)
# Parsing and tokenising need no tensors: their threads are not the worker's default executor's, which set up
# OpenMP for tensor work (and so import torch, which a simulated worker never loads).
_INPUT_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="request-input")
T = TypeVar("T")
_DIGITS = bytes.maketrans(b"0123456789", b"9999999999")
_LONG_RUN = b"9" * (MAX_INT_DIGITS + 1)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a request-input thread (a large body's parsing, a long prompt's tokenising)."""
    return await asyncio.get_running_loop().run_in_executor(_INPUT_THREADS, fn, *args)


def loads(raw: bytes | str) -> Any:
    """``json.loads`` with every number finite and integer literals bounded (APIError 400).

    The common body has no run of more than :data:`MAX_INT_DIGITS` digits anywhere (one C-speed scan finds out)
    and is parsed at full speed; only one that has such a run (in a string, or an integer literal) is parsed
    with a check on each integer."""
    data = raw.encode() if isinstance(raw, str) else raw
    text = raw if isinstance(raw, str) else data.decode(json.detect_encoding(data), "surrogatepass")  # as json.loads
    return (_CHECKING_INTS if _LONG_RUN in data.translate(_DIGITS) else _DECODER).decode(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(400, f"number {text[:40]} is out of range (not a finite double)")
    return value


def _no_constant(name: str) -> float:
    raise APIError(400, f"{name} is not a number JSON allows: every number must be finite")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(400, f"an integer of {len(text.lstrip('-'))} digits: at most {MAX_INT_DIGITS} are accepted")
    return int(text)


# made once: json.loads with hooks would build a decoder on every call
_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)
_CHECKING_INTS = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant, parse_int=_bounded_int)


def number(value: Any, name: str, low: float, high: float, default: float) -> float:
    """``value`` (None: ``default``) as a float in ``[low, high]``; APIError 400 naming ``name`` if it
    is no number, not finite or out of range (a string is parsed: query parameters are strings)."""
    if value is None:
        return default
    try:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError
        f = float(value)
    except (ValueError, OverflowError):
        raise APIError(400, f"{name} must be a number, got {str(value)[:40]!r}", name) from None
    if not (math.isfinite(f) and low <= f <= high):
        raise APIError(400, f"{name} must be a number in [{low:g}, {high:g}], got {str(value)[:40]}", name)
    return f


def check_prompts(prompts: list[Any], param: str = "prompt") -> None:
    """At most :data:`MAX_PROMPTS` prompts of at most :data:`MAX_PROMPT_CHARS` characters (texts) or token ids
    (lists) in all."""
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"{len(prompts)} prompts in one request: at most {MAX_PROMPTS}", param)
    check_chars(sum(len(p) for p in prompts if isinstance(p, str | list)), param)


def check_chars(total: int, param: str) -> None:
    if total > MAX_PROMPT_CHARS:
        raise APIError(400, f"{param} holds {total} characters: at most {MAX_PROMPT_CHARS} in one request", param)


def check_inputs(path: str, body: dict[str, Any]) -> None:
    """The router's check of a request's prompts or messages against these limits, whatever engine serves it
    (the worker checks each field in full): ``prompt`` in count and characters, ``messages`` in count and text."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        check_chars(len(prompt), "prompt")
    elif isinstance(prompt, list) and prompt:
        check_prompts(prompt if isinstance(prompt[0], str | list) else [prompt])
    messages = body.get("messages") if path.endswith(("/chat/completions", "/messages")) else None
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise APIError(400, f"{len(messages)} messages in one request: at most {MAX_MESSAGES}", "messages")
        check_chars(sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict)), "messages")


def input_chars(body: dict[str, Any]) -> int:
    """About how many characters a request's prompts or messages hold (what tokenising them costs)."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    if isinstance(messages, list):
        return sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    return 0


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0
