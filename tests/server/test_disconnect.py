"""A client that goes away aborts its request: the engine frees its KV blocks and the running/waiting
gauges return to zero. Checked through /metrics with a generous deadline, never with timings.

The worker runs one sequence at a time, so a second request waits in the queue.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx
import pytest

# Long enough that no request here finishes on its own before the client leaves.
# long enough to outlast every client timeout below at the default q4 speed (~110 tok/s): every such request is
# aborted, never run to its end
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
# How long the clients below wait for a response before giving up. The running request decodes at full speed all
# that time (what these tests cost), and the request only has to be seen running or queued before it: one engine
# step, tens of milliseconds, on an idle worker.
GIVE_UP_S = 2.0


@pytest.fixture(scope="module")
def one_seq_worker(worker_factory: Any) -> Any:
    return worker_factory("--max-num-seqs", "1")


def aborted_count(worker: Any) -> float:
    text = httpx.get(worker.base_url + "/metrics").text
    m = re.search(r'^vllm:request_success_total\{finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def busy(m: dict[str, float]) -> bool:
    return m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0


def stream_then_disconnect(worker: Any, path: str, body: dict[str, Any], chunks: int = 3) -> None:
    """Open a stream, read a few events while the request holds KV blocks, then close the connection."""
    with httpx.Client(timeout=60) as c, c.stream("POST", worker.base_url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(chunks):
            next(events)
        worker.wait_for_metrics(busy)  # the request really is running with blocks held


def test_closing_a_completion_stream_frees_its_blocks(one_seq_worker: Any) -> None:
    one_seq_worker.wait_idle()
    aborts = aborted_count(one_seq_worker)
    stream_then_disconnect(one_seq_worker, "/v1/completions", {"prompt": "Tell me a long story.", **LONG})
    one_seq_worker.wait_idle()
    assert aborted_count(one_seq_worker) == aborts + 1


def test_closing_a_chat_stream_frees_its_blocks(one_seq_worker: Any) -> None:
    one_seq_worker.wait_idle()
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], **LONG}
    stream_then_disconnect(one_seq_worker, "/v1/chat/completions", body)
    one_seq_worker.wait_idle()


def test_closing_a_stream_with_n_choices_aborts_every_choice(one_seq_worker: Any) -> None:
    one_seq_worker.wait_idle()
    aborts = aborted_count(one_seq_worker)
    body = {"prompt": "Tell me a long story.", "n": 2, **{**LONG, "temperature": 1.0}}
    stream_then_disconnect(one_seq_worker, "/v1/completions", body)
    one_seq_worker.wait_idle()
    assert aborted_count(one_seq_worker) == aborts + 2  # the running choice and the waiting one


@pytest.mark.slow
def test_a_non_streaming_client_timeout_frees_its_blocks(one_seq_worker: Any) -> None:
    one_seq_worker.wait_idle()
    aborts = aborted_count(one_seq_worker)
    result: dict[str, BaseException] = {}

    def call() -> None:
        try:
            httpx.post(one_seq_worker.base_url + "/v1/completions", json={"prompt": "Tell me a long story.", **LONG},
                       timeout=httpx.Timeout(60, read=GIVE_UP_S))
        except httpx.TimeoutException as e:
            result["error"] = e

    t = threading.Thread(target=call)
    t.start()
    one_seq_worker.wait_for_metrics(busy)
    t.join(timeout=60)
    assert isinstance(result.get("error"), httpx.TimeoutException)  # the client gave up first
    one_seq_worker.wait_idle()
    assert aborted_count(one_seq_worker) == aborts + 1


def leave_while_waiting(worker: Any, stream: bool) -> None:
    """Send a request that must wait behind the running one; give up on it while it still waits."""
    gave_up: dict[str, BaseException] = {}

    def call() -> None:
        try:
            httpx.post(worker.base_url + "/v1/completions",
                       json={"prompt": "Another story.", "stream": stream, **LONG}, timeout=httpx.Timeout(60, read=GIVE_UP_S))
        except httpx.TimeoutException as e:
            gave_up["error"] = e

    t = threading.Thread(target=call)
    t.start()
    worker.wait_for_metrics(lambda m: m["vllm:num_requests_waiting"] == 1)
    t.join(timeout=60)
    assert isinstance(gave_up.get("error"), httpx.TimeoutException)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_waiting_request_whose_client_leaves_leaves_the_queue(one_seq_worker: Any, stream: bool) -> None:
    one_seq_worker.wait_idle()
    base = one_seq_worker.base_url
    with httpx.Client(timeout=60) as c, c.stream("POST", base + "/v1/completions",
                                                 json={"prompt": "Tell me a long story.", "stream": True, **LONG}) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
        next(lines)
        leave_while_waiting(one_seq_worker, stream)
        # the queue empties while the first request still runs
        one_seq_worker.wait_for_metrics(lambda m: m["vllm:num_requests_waiting"] == 0 and busy(m))
    one_seq_worker.wait_idle()


def test_the_worker_serves_normally_after_disconnects(one_seq_worker: Any) -> None:
    r = httpx.post(one_seq_worker.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    one_seq_worker.wait_idle()
