"""Disaggregated prefill/decode over real workers and a real router, over HTTP.

One prefill worker, one decode worker and a colocated reference worker; the router disaggregates every
prompt with at least 32 uncached tokens. Outputs must equal the colocated ones token for token, the
remote leg's failures must end in correct answers, and no KV block may stay allocated anywhere.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from fleet_helpers import real_worker, router, wait_state

from fleetllm.disagg import frame
from fleetllm.disagg.buffers import remove_stale_files
from fleetllm.disagg.handoffs import HEADER as HANDOFF
from fleetllm.disagg.routes import SHM_DIR
from fleetllm.engine.block_pool import hash_prefix_blocks

pytestmark = pytest.mark.slow  # a worker process, kills and restarts

QUESTIONS = [
    "Explain what a circuit breaker does in a service mesh, in two sentences.",
    "Write a haiku about caches that forget.",
    "Why do long prompts slow down other requests on the same GPU?",
    "Give three tips for writing readable Python tests.",
]
SYSTEM = "You are a precise assistant for infrastructure engineers. Keep answers short and concrete."


def body(q: str) -> dict:
    return {"model": "smollm2-135m", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}


@pytest.fixture(scope="module")
def fleet(worker_factory):
    """The prefill worker is a process (the last test SIGKILLs it); decode, colocated and the router run
    in-process (the decode and colocated workers stop with the module, through ``worker_factory``)."""
    started = []
    try:
        # batch-invariant kernels: outputs under concurrency compared with the colocated worker's (else q4's
        # steps round differently below and from 4 rows, and batches differ between the fleets)
        p = real_worker("--role", "prefill", "--batch-invariant")
        started.append(p)
        d, c = worker_factory("--role", "decode", "--batch-invariant"), worker_factory("--batch-invariant")
        r = router([p.url, d.url], "kv_aware", "--pd-threshold", "32")
        started.append(r)
        wait_state(r.url, lambda s: all(w["healthy"] and w["events_connected"] for w in s["workers"]), 60)
        yield {"prefill": p, "decode": d, "colocated": c, "router": r}
    finally:
        for proc in reversed(started):
            proc.stop()


def answers(url: str, questions: list[str]) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body(q)) for q in questions))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0]["message"]["content"] for r in rs]

    return asyncio.run(run())


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_reaches(url: str, name: str, ok, timeout_s: float = 30.0) -> float:  # noqa: ANN001 - a predicate
    """``name``'s value once ``ok`` holds for it: the router counts a remote leg's outcome when the prefill worker
    answers, which may come after the request's own answer (the decode worker streams once the KV is in)."""
    deadline = time.monotonic() + timeout_s
    while not ok(value := metric(url, name)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def assert_no_blocks_held(*urls: str, decode=None) -> None:  # noqa: ANN001 - an in-process worker
    for u in urls:
        assert metric(u, "vllm:kv_cache_usage_perc") == 0.0, u
    if decode is not None:  # the gauge is set by steps; blocks leased for a direct write are held between them
        assert decode.worker.engine.pool.usage == 0.0


def test_disaggregated_outputs_equal_colocated_ones_under_concurrency(fleet):
    r, d, c = fleet["router"].url, fleet["decode"].url, fleet["colocated"].url
    expected = answers(c, QUESTIONS)
    assert answers(r, QUESTIONS) == expected
    # one decision per request; at most 2 remote prefills in flight per prefill worker (the rest of a burst is
    # "saturated"), and once the first is under way its prompt counts as the decode worker's: the shared system
    # prefix leaves the others below the threshold
    assert metric_reaches(r, "fleetllm_router_pd_decisions_total", lambda v: v >= len(QUESTIONS)) == len(QUESTIONS)
    assert metric(r, 'fleetllm_router_pd_decisions_total{decision="disaggregated"}') >= 1
    assert metric(d, 'fleetllm:kv_transfer_blocks_total{kind="imported"}') > 0
    # same host, the decode worker's pool shared: written straight into it, no frame
    assert metric(fleet["prefill"].url, 'fleetllm:kv_transfer_bytes_total{direction="sent",via="pool"}') > 0
    # again: now the decode worker holds the prompts itself, so nothing is prefilled remotely
    local_before = metric(r, 'fleetllm_router_pd_decisions_total{decision="local"}')
    assert answers(r, QUESTIONS) == expected
    assert metric(r, 'fleetllm_router_pd_decisions_total{decision="local"}') >= local_before + len(QUESTIONS)
    assert_no_blocks_held(fleet["prefill"].url, d, c, decode=fleet["decode"])


def test_the_decode_worker_starts_from_the_first_token_the_prefill_worker_sampled(fleet):
    r, c = fleet["router"].url, fleet["colocated"].url
    q = "Name two reasons to prefill a long prompt on another worker than the one that decodes it, briefly and plainly."
    b = {**body(q), "seed": 5, "temperature": 0.7}
    before = metric(r, 'fleetllm_router_pd_decisions_total{decision="disaggregated"}')
    remote = httpx.post(r + "/v1/chat/completions", json=b, timeout=300).json()
    name = 'fleetllm_router_pd_decisions_total{decision="disaggregated"}'
    assert metric_reaches(r, name, lambda v: v > before) == before + 1
    local = httpx.post(c + "/v1/chat/completions", json=b, timeout=300).json()
    assert remote["choices"] == local["choices"]  # seeded: the same draws, the first one on the prefill worker
    # the whole prompt arrived computed (its partial last block too): the decode worker computed none of it
    assert remote["usage"]["prompt_tokens_details"]["cached_tokens"] == remote["usage"]["prompt_tokens"]
    assert_no_blocks_held(fleet["prefill"].url, fleet["decode"].url, decode=fleet["decode"])


def _frame_for(tokens: list[int], num_layers: int = 30, kv_heads: int = 3, head_dim: int = 64) -> bytes:
    hashes = hash_prefix_blocks(tokens, 16, b"smollm2-135m")
    header = frame.FrameHeader("smollm2-135m", num_layers, kv_heads, head_dim, "float32", 16,
                               tokens[: len(hashes) * 16], hashes)
    shape = (len(hashes), 16, kv_heads, head_dim)
    return b"".join(frame.encode(header, [(torch.zeros(shape), torch.zeros(shape)) for _ in range(num_layers)]))


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "wrong_layout"])
def test_a_bad_frame_is_refused_and_leaves_no_block_behind(fleet, damage):
    d = fleet["decode"].url
    tokens = list(range(1000, 1000 + 48))
    data = bytearray(_frame_for(tokens, num_layers=2 if damage == "wrong_layout" else 30))
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 1000]
    r = httpx.post(d + "/pd/kv", content=bytes(data), headers={"content-type": "application/octet-stream"}, timeout=60)
    assert r.status_code == 400 and "frame" in r.json()["error"]["message"]
    assert metric(d, 'fleetllm:kv_transfer_failures_total{reason="bad_frame"}') >= 1
    assert_no_blocks_held(d)


@pytest.mark.parametrize("tokens", [48, 400])  # 400: a frame over the 16 MiB cap on request bodies
def test_a_well_formed_frame_over_http_is_imported_into_the_prefix_cache(fleet, tokens):
    d = fleet["decode"].url
    data = _frame_for(list(range(2000 * (tokens // 48), 2000 * (tokens // 48) + tokens)))  # blocks new to d
    r = httpx.post(d + "/pd/kv", content=data, headers={"content-type": "application/octet-stream"}, timeout=60)
    assert r.status_code == 200 and r.json()["imported"] == tokens // 16, (len(data), r.text[:200])
    assert_no_blocks_held(d)


def test_a_frame_streamed_over_http_while_the_prefill_computes_is_imported(fleet):
    # the same frame as over shared memory (test_kv_transfer: a streamed frame equals the exported one)
    p, d = fleet["prefill"].url, fleet["decode"].url
    q = "Over HTTP this time: name two reasons to stream KV layer by layer while a long prompt is prefilled."
    r = httpx.post(p + "/pd/prefill", json={"path": "/v1/chat/completions", "body": body(q), "decode_url": d,
                                            "transfer": "http"}, timeout=120)
    assert r.status_code == 200 and r.json()["via"] == "http", r.text
    shipped = r.json()
    assert shipped["imported"] + shipped["already_cached"] + shipped["tail"] == shipped["blocks"] > 0
    remote = httpx.post(d + "/v1/chat/completions", json=body(q), headers={HANDOFF: shipped["handoff"]}, timeout=120)
    assert remote.json()["choices"] == httpx.post(fleet["colocated"].url + "/v1/chat/completions", json=body(q),
                                                  timeout=120).json()["choices"]
    assert remote.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == shipped["prompt_tokens"]
    assert_no_blocks_held(p, d, decode=fleet["decode"])


def test_a_transfer_timeout_falls_back_to_a_local_prefill(fleet):
    p, d = fleet["prefill"].url, fleet["decode"].url
    r2 = router([p, d], "kv_aware", "--pd-threshold", "32", "--pd-timeout", "0.05")
    try:
        wait_state(r2.url, lambda s: all(w["healthy"] and w["events_connected"] for w in s["workers"]), 60)
        q = ["Describe a timeout in one sentence, please, for a junior engineer who is new to networks."]
        assert answers(r2.url, q) == answers(fleet["colocated"].url, q)
        assert metric_reaches(r2.url, 'fleetllm_router_pd_decisions_total{decision="fallback"}', lambda v: v > 0) == 1
    finally:
        r2.stop()
    # the prefill worker's abandoned request is aborted: nothing stays allocated
    wait_state(fleet["router"].url, lambda s: all(w["inflight"] == 0 for w in s["workers"]))
    for u in (p, d):
        end = 30
        while metric(u, "vllm:kv_cache_usage_perc") != 0.0 and end:
            asyncio.run(asyncio.sleep(0.5))
            end -= 1
    assert_no_blocks_held(p, d)


def test_a_decode_worker_dying_under_the_p_d_path_costs_no_request(fleet, worker_factory):
    d2 = worker_factory("--role", "decode")  # in-process: its port closes as a killed process's would
    r = router([fleet["prefill"].url, fleet["decode"].url, d2.url], "round_robin", "--pd-threshold", "32")
    try:
        wait_state(r.url, lambda s: all(w["healthy"] and w["events_connected"] for w in s["workers"]), 60)
        d2.stop()  # the router has not noticed yet: KV gets pushed to a dead worker, then a retry
        qs = [f"In one sentence: what is failover number {i}?" for i in range(4)]
        assert answers(r.url, qs) == answers(fleet["colocated"].url, qs)
        assert_no_blocks_held(fleet["prefill"].url, fleet["decode"].url)
    finally:
        r.stop()


def test_a_prefill_worker_killed_mid_prefill_costs_no_request(fleet):
    r, c = fleet["router"].url, fleet["colocated"].url
    # a prompt long enough that its remote prefill takes a while on one CPU thread (~600 tokens: over a second of
    # batch-invariant prefill, killed half a second in); the decode worker and the colocated one compute it again
    q = ["Summarise this log for an on-call engineer: " + "worker 3 restarted after an out of memory error; " * 50]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            task = asyncio.create_task(client.post(r + "/v1/chat/completions", json=body(q[0])))
            await asyncio.sleep(0.5)
            fleet["prefill"].kill()  # SIGKILL while it computes the prompt's KV
            resp = await task
        assert resp.status_code == 200, resp.text
        return [resp.json()["choices"][0]["message"]["content"]]

    assert asyncio.run(run()) == answers(c, q)  # the remote leg failed: prefilled locally, same tokens
    assert metric_reaches(r, 'fleetllm_router_pd_decisions_total{decision="fallback"}', lambda v: v > 0) >= 1
    # its lease on the decode worker's blocks ended with it (the writer's process is gone)
    assert_no_blocks_held(fleet["decode"].url, decode=fleet["decode"])
    # the killed worker's frame files outlive it, until a worker that ships frames starts: then they go
    remove_stale_files(SHM_DIR)
    assert not list(SHM_DIR.glob(f"fleetllm-kv-{fleet['prefill'].popen.pid}-*"))
