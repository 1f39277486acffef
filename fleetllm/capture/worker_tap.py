"""The worker tier: a request as the engine saw it (templated prompt, output, tokens, phase times).

The worker opens a :class:`WorkerTap` per sampled request (sampled on the router's
``x-fleetllm-request-id``, so it agrees with the router's tiers; a worker called directly samples on
its own id), feeds it every output as it streams, and ends it when the request ends however it ends:
finished, failed (with its status) or abandoned by its client (``aborted``, with the tokens it had).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fleetllm.capture.records import REFUSED, iso_time
from fleetllm.engine.outputs import RequestOutput, RequestTiming

if TYPE_CHECKING:
    from fleetllm.capture.recorder import Capture  # its envelope imports cryptography

REQUEST_ID_HEADER = "x-fleetllm-request-id"


class WorkerTap:
    """One request's outputs, accumulated while it runs."""

    def __init__(self, capture: Capture, request_id: str, client_id: str | None, kind: str, model: str,
                 prompts: list[list[int]], n: int, decode: Callable[[list[int]], str], lora_name: str | None = None) -> None:
        self.capture, self.request_id, self.client_id = capture, request_id, client_id
        self.lora_name = lora_name  # the LoRA adapter the request ran with (None: the base model)
        self.kind, self.model, self.prompts, self.decode = kind, model, prompts, decode
        self.expected = len(prompts) * n
        self.arrived = time.time()
        self.texts: dict[int, list[str]] = {}
        self.last: dict[int, RequestOutput] = {}

    def output(self, index: int, out: RequestOutput) -> None:
        """One streamed output of choice ``index``."""
        self.texts.setdefault(index, []).append(out.new_text)
        self.last[index] = out

    def end(self, status: int) -> None:
        """Write the record (once the request has ended, however it ended)."""
        with self.capture.guard("worker"):
            self._end(status)

    def _end(self, status: int) -> None:
        if status in REFUSED:  # a caller without the credentials: nothing of its request is kept
            return
        c, flags = self.capture, set()
        finished = [o for o in self.last.values() if o.finished]
        aborted = status == 200 and len(finished) < self.expected
        record: dict[str, Any] = {
            "request_id": self.request_id, "client_request_id": self.client_id, "time": iso_time(self.arrived),
            "worker": c.component, "model": self.model, "lora_name": self.lora_name, "kind": self.kind, "status": 499 if aborted else status,
            "aborted": aborted,
        }
        if c.keeps("input"):
            texts = [c.payload("worker", self.decode(ids), flags) for ids in self.prompts]
            if any(t is None for t in texts):
                c.write("worker", None)
                return
            record["prompt"] = [{"text": t, "num_tokens": len(ids)} for t, ids in zip(texts, self.prompts, strict=True)]
        if c.keeps("output"):
            outputs = []
            for i in sorted(self.texts):
                text = c.payload("worker", "".join(self.texts[i]), flags)
                if text is None:
                    c.write("worker", None)
                    return
                o = self.last[i]
                outputs.append({"index": i, "text": text, "finish_reason": o.finish_reason,
                                "num_tokens": o.num_output_tokens, "error": o.error})
            record["output"] = outputs
        record.update(self._numbers())
        c.write("worker", record, flags)

    def _numbers(self) -> dict[str, Any]:
        outs = list(self.last.values())
        first = outs[0] if outs else None
        timing = next((o.timing for o in outs if o.timing), None)
        return {
            "usage": {"prompt_tokens": first.num_prompt_tokens if first else 0,
                      "completion_tokens": sum(o.num_output_tokens for o in outs),
                      "cached_tokens": first.num_cached_tokens if first else 0},
            "timing": _phases(timing),
            "speculative": None,  # per-request acceptance is not reported by the engine yet
        }


def _phases(t: RequestTiming | None) -> dict[str, float | None]:
    if t is None:
        return {"queue_s": None, "prefill_s": None, "decode_s": None, "e2e_s": None}

    def span(a: float | None, b: float | None) -> float | None:
        return round(b - a, 6) if a is not None and b is not None else None

    return {"queue_s": span(t.arrival, t.scheduled), "prefill_s": span(t.scheduled, t.first_token),
            "decode_s": span(t.first_token, t.finished), "e2e_s": span(t.arrival, t.finished)}


def open_worker_tap(capture: Capture | None, headers: Mapping[str, str], rid: str, kind: str, model: str,
                    prompts: list[list[int]], n: int, decode: Callable[[list[int]], str],
                    lora_name: str | None = None) -> WorkerTap | None:
    """A tap when the worker tier captures this request (its router's id, else the worker's own)."""
    if capture is None:
        return None
    request_id = headers.get(REQUEST_ID_HEADER) or rid
    if not capture.wants("worker", request_id):
        return None
    return WorkerTap(capture, request_id, headers.get("x-request-id"), kind, model, prompts, n, decode, lora_name)
