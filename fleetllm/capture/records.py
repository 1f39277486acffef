"""The three record formats, as plain dicts ready to be written as one JSON line each.

- endpoint: a SageMaker Data Capture line (``captureData`` / ``eventMetadata`` / ``eventVersion``), with
  fleetllm's own facts (status, stream, aborted, truncated) under a separate top-level ``fleetllm`` key;
- access: :data:`ACCESS_FIELDS`, in that order (documented in docs/capture.md);
- worker: the prompt and output as the engine saw them, token counts and phase times.
"""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime
from typing import Any

# refused before authentication (or authorisation): the body is a stranger's, never captured; metadata only
REFUSED = frozenset({401, 403})

# the access tier's fields, in the order every line holds them (times in seconds, -1 when unknown)
ACCESS_FIELDS = (
    "time", "client", "client_port", "method", "path", "status", "bytes_in", "bytes_out",
    "request_processing_time", "target_processing_time", "response_processing_time", "time_to_first_byte",
    "worker", "routing", "request_id", "client_request_id", "key_id", "model", "stream", "lora_name",
)


def iso_time(t: float) -> str:
    """``t`` (epoch seconds) as SageMaker writes ``inferenceTime``, to the millisecond, in UTC."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def payload(data: bytes | str, content_type: str, mode: str) -> dict[str, Any]:
    """One side of ``captureData``: JSON text as is when it is UTF-8 JSON, base64 otherwise."""
    text: str | None
    if isinstance(data, str):
        text = data
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is not None and "json" in content_type:
        return {"observedContentType": content_type, "mode": mode, "data": text, "encoding": "JSON"}
    raw = data if isinstance(data, bytes) else data.encode()
    return {"observedContentType": content_type, "mode": mode, "data": base64.b64encode(raw).decode(),
            "encoding": "BASE64"}


def endpoint_record(request_id: str, when: float, request: dict[str, Any] | None,
                    response: dict[str, Any] | None, extra: dict[str, Any]) -> dict[str, Any]:
    """A SageMaker Data Capture line; ``request`` / ``response`` are :func:`payload` dicts (None: not kept)."""
    data: dict[str, Any] = {}
    if request is not None:
        data["endpointInput"] = request
    if response is not None:
        data["endpointOutput"] = response
    return {"captureData": data,
            "eventMetadata": {"eventId": str(uuid.uuid4()), "inferenceTime": iso_time(when),
                              "inferenceId": request_id},
            "eventVersion": "0",
            "fleetllm": extra}


def access_record(values: dict[str, Any]) -> dict[str, Any]:
    """An access line: every field of :data:`ACCESS_FIELDS` in order (None where unknown)."""
    return {k: values.get(k) for k in ACCESS_FIELDS}


def record_id(tier: str, record: dict[str, Any]) -> str | None:
    """The request id a record of ``tier`` belongs to (what joins the tiers)."""
    if tier == "endpoint":
        return (record.get("eventMetadata") or {}).get("inferenceId")
    return record.get("request_id")


def record_time(tier: str, record: dict[str, Any]) -> float:
    """When the request a record describes arrived (epoch seconds; 0 when unknown)."""
    when = (record.get("eventMetadata") or {}).get("inferenceTime") if tier == "endpoint" else record.get("time")
    if isinstance(when, int | float):
        return float(when)
    if isinstance(when, str):
        try:
            return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0
    return 0.0


def record_status(tier: str, record: dict[str, Any]) -> int | None:
    """The HTTP status the client got (as far as the tier knows)."""
    return (record.get("fleetllm") or {}).get("status") if tier == "endpoint" else record.get("status")


def tier_of(record: dict[str, Any]) -> str:
    """Which tier wrote ``record`` (read back from a mixed directory)."""
    if "captureData" in record:
        return "endpoint"
    return "worker" if "prompt" in record or "output" in record else "access"
