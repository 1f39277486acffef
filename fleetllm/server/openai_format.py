"""OpenAI response objects and server-sent events, built from engine outputs by pure functions.

Nothing here touches a request, a socket or the engine: each function maps :class:`RequestOutput` values
(and a ``token_text`` function that turns a token id into its text) to the JSON the OpenAI API answers,
so the exact shape of every field can be tested without a server. ``kind`` is ``"chat"`` for
``/v1/chat/completions`` and ``"text"`` for ``/v1/completions``.

Usage follows OpenAI's rule for ``n > 1``: each prompt's tokens count once, every choice's output counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fleetllm.engine.outputs import RequestOutput
from fleetllm.server.protocol import APIError

TokenText = Callable[[int], str]
TokenCounts = tuple[int, int, int]  # prompt, completion and cached tokens of one choice

SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: Any, ensure_ascii: bool = True) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=ensure_ascii)}\n\n"


def error_event(message: str, status: int = 500) -> str:
    """The event a stream carries when a request fails after its first byte (``status`` in the body)."""
    return sse_event(APIError(status, message).body())


def finish_reason(out: RequestOutput) -> str | None:
    """The OpenAI ``finish_reason`` of a finished output (``stop``, ``length``, ``abort``, ``error``)."""
    return {"abort": "abort", "error": "error"}.get(out.finish_reason or "", out.finish_reason)


def token_counts(out: RequestOutput) -> TokenCounts:
    return out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def total_usage(counts: dict[int, TokenCounts], n: int) -> dict[str, Any]:
    """Usage over all choices (keyed by choice index; choices ``p*n .. p*n+n-1`` share prompt ``p``)."""
    firsts = [c for i, c in counts.items() if i % n == 0]
    return usage(sum(p for p, _, _ in firsts), sum(o for _, o, _ in counts.values()), sum(c for _, _, c in firsts))


def chat_logprobs(out: RequestOutput, token_text: TokenText) -> dict[str, Any] | None:
    """Chat ``logprobs`` of the tokens new in ``out`` (None when it carries none)."""
    if not out.logprobs:
        return None
    content = []
    for t in out.logprobs:
        s = token_text(t.token_id)
        top = [{"token": token_text(i), "logprob": lp, "bytes": list(token_text(i).encode())} for i, lp in t.top]
        content.append({"token": s, "logprob": t.logprob, "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}


def text_logprobs(out: RequestOutput, token_text: TokenText, offset: int = 0) -> dict[str, Any] | None:
    """Completions ``logprobs`` of the tokens new in ``out`` (None when it carries none)."""
    if not out.logprobs:
        return None
    return {"tokens": [token_text(t.token_id) for t in out.logprobs],
            "token_logprobs": [t.logprob for t in out.logprobs],
            "top_logprobs": [{token_text(i): lp for i, lp in t.top} for t in out.logprobs],
            "text_offset": [offset] * len(out.logprobs)}


def object_name(kind: str, stream: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


# ---- a whole response -------------------------------------------------------------------------------
def completion_response(kind: str, cid: str, model: str, created: int, outs: list[tuple[int, RequestOutput]],
                        num_choices: int, n: int, token_text: TokenText,
                        prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """The non-streamed response from every (choice index, output) of a request, in arrival order.

    ``prompts`` (vLLM's ``return_token_ids``): each choice also carries its ``prompt_token_ids`` and ``token_ids``.
    Raises :class:`APIError` (500) if an output carries an engine error."""
    texts = [""] * num_choices
    ids: list[list[int]] = [[] for _ in range(num_choices)]
    with_logprobs: list[list[RequestOutput]] = [[] for _ in range(num_choices)]
    final: dict[int, RequestOutput] = {}
    for index, out in outs:
        if out.error:
            raise APIError(500, out.error)
        texts[index] += out.new_text
        ids[index] += out.new_token_ids
        if out.logprobs:
            with_logprobs[index].append(out)
        if out.finished:
            final[index] = out
    make = _chat_choice if kind == "chat" else _text_choice
    choices = [make(i, texts[i], final[i], with_logprobs[i], token_text) for i in range(num_choices)]
    if prompts is not None:
        for i, c in enumerate(choices):
            c["prompt_token_ids"], c["token_ids"] = prompts[i // n], ids[i]
    counts = {i: token_counts(f) for i, f in final.items()}
    return {"id": cid, "object": object_name(kind, stream=False), "created": created, "model": model,
            "choices": choices, "usage": total_usage(counts, n)}


def _chat_choice(index: int, text: str, final: RequestOutput, parts: list[RequestOutput],
                 token_text: TokenText) -> dict[str, Any]:
    lp = None
    if final.logprobs is not None or parts:
        lp = {"content": [c for o in parts for c in chat_logprobs(o, token_text)["content"]]}  # type: ignore[index]
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
            "finish_reason": finish_reason(final), "stop_reason": final.stop_reason}


def _text_choice(index: int, text: str, final: RequestOutput, parts: list[RequestOutput],
                 token_text: TokenText) -> dict[str, Any]:
    lp = None
    if parts:
        each = [text_logprobs(o, token_text) for o in parts]
        lp = {k: [v for p in each for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs")}  # type: ignore[index]
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason(final),
            "stop_reason": final.stop_reason}


# ---- a streamed response ------------------------------------------------------------------------------
def add_token_ids(choices: list[dict[str, Any]], out: RequestOutput, prompt: list[int] | None) -> None:
    """``return_token_ids`` on a stream: the first chunk of ``out`` carries its new token ids (the rest none), and
    the choice's first chunk its ``prompt_token_ids`` (``prompt`` given)."""
    carrier = next((k for k, c in enumerate(choices) if c.get("text") or (c.get("delta") or {}).get("content")), 0)
    for k, c in enumerate(choices):
        c["token_ids"] = list(out.new_token_ids) if k == carrier else []
    if prompt is not None and choices:
        choices[0]["prompt_token_ids"] = prompt


def stream_choices(kind: str, index: int, out: RequestOutput, first: bool, token_text: TokenText,
                   every_token: bool = False) -> list[dict[str, Any]]:
    """The chunk choices one output of choice ``index`` streams, one chunk each (possibly none).

    ``first`` says this is the choice's first output: a chat stream opens each choice with the role.
    ``every_token``: an output that made tokens whose text is still held back (the first bytes of a character
    split over several tokens) streams a choice with empty text, as vLLM's do: a client sees each token when it
    is made, and times its first token as the engine does, not three tokens later."""
    made = every_token and bool(out.new_token_ids)
    if kind != "chat":
        if not (out.new_text or out.finished or out.logprobs or made):
            return []
        return [{"index": index, "text": out.new_text, "logprobs": text_logprobs(out, token_text),
                 "finish_reason": finish_reason(out) if out.finished else None,
                 "stop_reason": out.stop_reason if out.finished else None}]
    choices = []
    if first:
        choices.append({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
    if out.new_text or out.logprobs or (made and not first):  # a first output's role chunk already shows it
        choices.append({"index": index, "delta": {"content": out.new_text},
                        "logprobs": chat_logprobs(out, token_text), "finish_reason": None})
    if out.finished:
        choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(out),
                        "stop_reason": out.stop_reason})
    return choices


def chunk_event(kind: str, cid: str, model: str, created: int, choices: list[dict[str, Any]],
                usage: dict[str, Any] | None = None) -> str:
    """One streamed chunk as a server-sent event (text kept as UTF-8, not escaped)."""
    obj: dict[str, Any] = {"id": cid, "object": object_name(kind, stream=True), "created": created, "model": model,
                           "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return sse_event(obj, ensure_ascii=False)
