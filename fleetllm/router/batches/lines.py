"""An input file's lines, and the lines OpenAI's Batch API writes to the output and error files.

Input line: ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}``.
Output line: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``;
error line: ``{"id", "custom_id", "response": null, "error": {"code", "message"}}``. Pure functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fleetllm.router.batches.store import new_id

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class Line:
    """One input line: the request to make, or why it cannot be made (``error``: code, message)."""

    index: int
    custom_id: str | None
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None


def parse_lines(data: bytes, endpoint: str | None = None) -> list[Line]:
    """Every non-blank line of ``data``; with ``endpoint``, a line for another URL is an error line."""
    out = []
    for raw in data.splitlines():
        if raw.strip():
            out.append(parse_line(len(out), raw, endpoint))
    return out


def parse_line(index: int, raw: bytes, endpoint: str | None) -> Line:
    try:
        obj = json.loads(raw)
    except ValueError:
        return Line(index, None, error=("invalid_json", f"line {index + 1} is not JSON"))
    if not isinstance(obj, dict):
        return Line(index, None, error=("invalid_request", f"line {index + 1} is not a JSON object"))
    cid = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    body = obj.get("body")
    problem = (
        "custom_id must be a string" if cid is None
        else "method must be POST" if obj.get("method") != "POST"
        else f"url must be one of {', '.join(ENDPOINTS)}" if obj.get("url") not in ENDPOINTS
        else "body must be a JSON object" if not isinstance(body, dict)
        else "streaming is not available in a batch" if body.get("stream")
        else f"url {obj['url']} is not the batch's endpoint {endpoint}" if endpoint and obj["url"] != endpoint
        else None
    )
    if problem is not None:
        return Line(index, cid, error=("invalid_request", f"line {index + 1}: {problem}"))
    return Line(index, cid, body=body)


def output_line(custom_id: str | None, status: int, request_id: str, body: Any) -> dict[str, Any]:
    return {"id": new_id("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)
