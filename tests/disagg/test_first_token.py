"""The first token of a remote prefill, over HTTP: sampled on the prefill worker, streamed by the decode worker.

In-process workers over the session's weights: a prefill worker, a decode worker sharing its pool (direct
writes), one keeping it private (frames), and a colocated reference, all with batch-invariant kernels.
A request forwarded with its handoff (``x-fleetllm-kv-handoff``) must answer exactly what the colocated
worker answers, whatever the prompt's length, sampling or stop; a handoff nobody claims, or a client gone
mid-stream, must leave no block held.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from fleetllm.disagg import handoffs
from fleetllm.disagg.handoffs import HEADER as HANDOFF

BLOCK = 16


@pytest.fixture(scope="module")
def pd(worker_factory):
    # batch-invariant kernels: a prompt computed whole (colocated) and one finished by another worker after a
    # prefix-cache hit or in other chunks take the same arithmetic (else q4's bf16 steps from 4 rows and int16
    # ones below round apart)
    inv = "--batch-invariant"
    return {"decode": worker_factory("--role", "decode", inv), "prefill": worker_factory("--role", "prefill", inv),
            "private": worker_factory("--role", "decode", "--kv-pool-shm", "off", inv),
            "colocated": worker_factory(inv)}


def completion(n: int, salt: int, **kw: object) -> dict:
    """A completions request of exactly ``n`` prompt tokens (fresh for each ``salt``)."""
    ids = [(salt * 7919 + i * 104729) % 40000 + 100 for i in range(n)]
    return {"model": "smollm2-135m", "prompt": ids, "max_tokens": 8, "temperature": 0, **kw}


def handed_over(pd: dict, body: dict, decode: str = "decode") -> str:
    """Prefill ``body`` on the prefill worker into ``decode``; the handoff id."""
    r = httpx.post(pd["prefill"].url + "/pd/prefill", json={"path": "/v1/completions", "body": body,
                                                            "decode_url": pd[decode].url, "transfer": "shm"},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["handoff"]


def answer(url: str, body: dict, handoff: str | None = None) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, headers={HANDOFF: handoff} if handoff else None, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def no_blocks_held(w, deadline_s: float = 30.0) -> None:  # noqa: ANN001 - an in-process worker
    end = time.monotonic() + deadline_s
    while w.worker.engine.pool.usage != 0.0 or len(w.worker.handoffs):
        assert time.monotonic() < end, f"{w.worker.engine.pool.usage:.1%} of {w.url}'s blocks still held"
        time.sleep(0.05)


@pytest.mark.parametrize("via", ["decode", "private"])  # a direct write into the pool; a frame
@pytest.mark.parametrize("n", [4 * BLOCK, 4 * BLOCK + 7])  # every block full; a partial last block
def test_a_handed_over_request_answers_the_colocated_tokens(pd, via, n):
    body = completion(n, n + len(via))
    remote = answer(pd[via].url, body, handed_over(pd, body, via))
    local = answer(pd["colocated"].url, body)
    assert remote["choices"][0]["text"] == local["choices"][0]["text"]
    assert remote["usage"]["prompt_tokens"] == local["usage"]["prompt_tokens"] == n
    assert remote["usage"]["completion_tokens"] == local["usage"]["completion_tokens"]
    assert remote["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    no_blocks_held(pd[via])


def test_a_seeded_sample_is_the_colocated_one(pd):
    body = completion(70, 1, temperature=1.0, seed=99, max_tokens=12)
    assert answer(pd["decode"].url, body, handed_over(pd, body))["choices"] == answer(pd["colocated"].url,
                                                                                       body)["choices"]


def test_logprobs_are_the_colocated_ones(pd):
    body = completion(70, 2, logprobs=2, max_tokens=4)
    remote = answer(pd["decode"].url, body, handed_over(pd, body))["choices"][0]["logprobs"]
    local = answer(pd["colocated"].url, body)["choices"][0]["logprobs"]
    assert remote["tokens"] == local["tokens"]
    assert [sorted(t) for t in remote["top_logprobs"]] == [sorted(t) for t in local["top_logprobs"]]
    # the prefill worker runs its layers op by op (torch's norms, RoPE, SiLU) where the colocated one runs a short
    # prompt through the C decode stack: the same kernels for GEMMs and attention, other float rounding elsewhere
    # (measured: up to 1.3e-3 apart; a prompt whose KV went astray would be whole nats apart)
    assert remote["token_logprobs"] == pytest.approx(local["token_logprobs"], abs=5e-3)


@pytest.mark.parametrize("stop", ["max_tokens", "stop_string"])
def test_a_request_ended_by_its_first_token_answers_it_alone(pd, stop):
    body = completion(70, 3, max_tokens=1)
    first = answer(pd["colocated"].url, body)["choices"][0]["text"]
    if stop == "stop_string":
        body = {**body, "max_tokens": 8, "stop": [first]}
    remote = answer(pd["decode"].url, body, handed_over(pd, body))
    local = answer(pd["colocated"].url, body)
    assert remote["choices"][0] == local["choices"][0]
    assert remote["choices"][0]["finish_reason"] == ("length" if stop == "max_tokens" else "stop")
    assert remote["usage"]["completion_tokens"] == 1
    no_blocks_held(pd["decode"])


def test_the_first_token_is_the_first_streamed_chunk(pd):
    body = completion(70, 4, stream=True)
    hid = handed_over(pd, body)
    with httpx.stream("POST", pd["decode"].url + "/v1/completions", json=body, headers={HANDOFF: hid},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    local = answer(pd["colocated"].url, {**body, "stream": False})["choices"][0]["text"]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == local and texts[0] and local.startswith(texts[0])


def test_a_handoff_nobody_claims_is_freed(pd, monkeypatch):
    monkeypatch.setattr(handoffs, "TTL_S", 0.2)
    handed_over(pd, completion(70, 5))
    assert pd["decode"].worker.engine.pool.usage > 0.0  # held for a request that never comes
    no_blocks_held(pd["decode"])


def test_a_client_gone_mid_stream_frees_the_handed_over_blocks(pd):
    body = completion(70, 6, stream=True, max_tokens=200, ignore_eos=True)
    hid = handed_over(pd, body)
    with httpx.stream("POST", pd["decode"].url + "/v1/completions", json=body, headers={HANDOFF: hid},
                      timeout=120) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))  # the first token, then leave
    no_blocks_held(pd["decode"])


def test_a_handoff_named_by_a_request_for_another_prompt_is_dropped(pd):
    hid = handed_over(pd, completion(70, 7))
    body = completion(70, 8)
    assert answer(pd["decode"].url, body, hid)["choices"] == answer(pd["colocated"].url, body)["choices"]
    no_blocks_held(pd["decode"])


def test_only_the_full_blocks_of_a_handed_over_prompt_are_prefix_hits(pd):
    body = completion(4 * BLOCK + 7, 9, max_tokens=2)
    answer(pd["decode"].url, body, handed_over(pd, body))
    longer = {**body, "prompt": body["prompt"] + [200] * 40}  # shares the handed-over prompt, and more
    assert answer(pd["decode"].url, longer)["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
