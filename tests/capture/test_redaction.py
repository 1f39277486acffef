"""Redaction sees what a reader of the capture sees (decoded JSON strings), and a request refused for its
credentials leaves no body in any capture."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse

from fleetllm.capture.config import CaptureConfig
from fleetllm.capture.reader import CaptureSource
from fleetllm.capture.recorder import Capture
from fleetllm.capture.redaction import MASK, Redactor
from fleetllm.capture.router_tap import RequestTap


def test_an_escaped_secret_and_an_escaped_non_ascii_pattern_are_redacted():
    # what a client may send: every character of the key and the accented word as \uXXXX escapes
    body = ('{"messages": [{"role": "user", "content": "key sk-\\u0041BCDEFGH12345678 at caf\\u00e9 \\"X\\""}],'
            ' "api\\u005fkey": "plain-secret", "n": 1}')
    text, hit = Redactor([r"sk-[A-Za-z0-9]{16}", "café"]).json_text(body)
    doc = json.loads(text)
    assert doc["messages"][0]["content"] == f'key {MASK} at {MASK} "X"' and hit
    assert doc["api_key"] == MASK and doc["n"] == 1
    assert "ABCDEFGH" not in text and "plain-secret" not in text


def test_json_with_nothing_to_redact_is_kept_byte_for_byte():
    body = '{"prompt":  "line one\\nline two", "max_tokens": 3}'
    assert Redactor([r"sk-\w+"]).json_text(body) == (body, False)


def _request(body: bytes) -> tuple[Request, list[bool]]:
    read = []

    async def receive() -> dict:
        read.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
             "query_string": b"", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    return Request(scope, receive), read


def test_a_request_refused_for_its_credentials_leaves_its_access_line_only(tmp_path: Path):
    cap = Capture(CaptureConfig(destination=str(tmp_path / "out")), "router", ("endpoint", "access"))
    request, read = _request(b'{"messages": [{"role": "user", "content": "a stranger\'s prompt"}]}')
    tap = RequestTap(cap, request, "rid-1", endpoint=True, access=True)
    refused = JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
    assert asyncio.run(tap.finish(refused)) is refused
    cap.close()
    records = list(CaptureSource(tmp_path / "out").records())
    assert [(t, r["status"], r["bytes_in"]) for _, t, r in records] == [("access", 401, 0)]
    assert not read  # the body was never even read
    assert b"stranger" not in b"".join(p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file())
