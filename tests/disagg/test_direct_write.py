"""A prefill worker writing a prompt's KV straight into a same-host decode worker's shared pool.

In-process workers over the session's weights: a decode worker (its pool in /dev/shm), a prefill worker, a
decode worker whose pool is private, and the session's default worker as the colocated reference. Leases
must end (commit, release, expiry, a dead writer) with no block held, and outputs must equal colocated ones.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import torch

from fleetllm.disagg import direct, shared_pool
from fleetllm.disagg.direct import PoolTarget
from fleetllm.disagg.frame import FrameError, FrameHeader
from fleetllm.disagg.handoffs import HEADER as HANDOFF
from fleetllm.disagg.leases import pid_namespace
from fleetllm.disagg.prefill_side import prefilled_tokens
from fleetllm.disagg.shared_pool import PoolLayout, PoolMaps
from fleetllm.engine.block_pool import hash_prefix_blocks
from fleetllm.engine.kv_memory import POOL_PREFIX, SharedKVFile, remove_stale_pools, shm_dir

if TYPE_CHECKING:
    from conftest import InProcessWorker

# The prefill worker's step budget: a "long" prompt (prefilled in chunks) is one past it. Half the default (512), so
# that such prompts, computed by the prefill worker and again by the colocated reference, cost a third as much.
PREFILL_BUDGET = 256


@pytest.fixture(scope="module")
def pd(worker_factory, worker):
    return {"decode": worker_factory("--role", "decode"),
            "prefill": worker_factory("--role", "prefill", "--max-num-batched-tokens", str(PREFILL_BUDGET)),
            "private": worker_factory("--role", "decode", "--kv-pool-shm", "off"), "colocated": worker}


def chat(q: str) -> dict:
    return {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": q}]}


def remote_prefill(prefill_url: str, decode_url: str, body: dict, **kw: object) -> httpx.Response:
    return httpx.post(prefill_url + "/pd/prefill", json={"path": "/v1/chat/completions", "body": body,
                                                         "decode_url": decode_url, "transfer": "shm"}, **kw)


def header_for(tokens: list[int]) -> dict:
    hashes = hash_prefix_blocks(tokens, 16, b"smollm2-135m")
    return FrameHeader("smollm2-135m", 30, 3, 64, "float32", 16, tokens[: len(hashes) * 16], hashes).to_json()


def reserve(url: str, tokens: list[int], **spec: object) -> dict:
    r = httpx.post(url + "/pd/reserve", json={"header": header_for(tokens), "lease_s": 60, **spec}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def held(w: InProcessWorker) -> float:
    """The share of ``w``'s pool blocks held (its gauge is set by engine steps only; a lease takes none)."""
    return w.worker.engine.pool.usage


def no_blocks_held(w: InProcessWorker, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while held(w) != 0.0:
        assert time.monotonic() < end, f"{held(w):.1%} of {w.url}'s blocks still held"
        time.sleep(0.05)


def test_a_direct_write_gives_the_tokens_of_a_colocated_prefill(pd):
    p, d = pd["prefill"].url, pd["decode"].url
    body = chat("Straight into the decode pool: explain in two sentences why a shared pool needs no copy. " * 2)
    r = remote_prefill(p, d, body, timeout=120)
    assert r.status_code == 200, r.text
    shipped = r.json()
    assert shipped["via"] == "pool" and shipped["imported"] + shipped["tail"] == shipped["blocks"] > 0
    assert shipped["in_place"]  # a prefill worker computes in the decode worker's blocks themselves
    ttft_before = pd["decode"].metrics().get("vllm:time_to_first_token_seconds_count", 0.0)
    remote = httpx.post(d + "/v1/chat/completions", json=body, headers={HANDOFF: shipped["handoff"]}, timeout=120).json()
    local = httpx.post(pd["colocated"].url + "/v1/chat/completions", json=body, timeout=120).json()
    assert remote["choices"][0]["message"]["content"] == local["choices"][0]["message"]["content"]
    assert remote["usage"]["prompt_tokens"] == local["usage"]["prompt_tokens"] == shipped["prompt_tokens"]
    assert remote["usage"]["completion_tokens"] == local["usage"]["completion_tokens"]
    # the written KV, the partial block too, was used: the whole prompt arrived computed
    assert remote["usage"]["prompt_tokens_details"]["cached_tokens"] == shipped["prompt_tokens"]
    assert pd["decode"].metrics()["vllm:time_to_first_token_seconds_count"] == ttft_before + 1
    assert pd["prefill"].metrics()["fleetllm:kv_transfer_bytes_total"] >= shipped["bytes"] > 0
    no_blocks_held(pd["decode"])
    no_blocks_held(pd["prefill"])


def test_without_a_shared_pool_the_prefill_falls_back_to_a_shared_memory_frame(pd):
    p, d = pd["prefill"].url, pd["private"].url
    assert httpx.post(d + "/pd/reserve", json={"header": header_for(list(range(64)))}).status_code == 409
    body = chat("A private pool: the KV comes as a frame in /dev/shm instead, checked by CRC.")
    r = remote_prefill(p, d, body, timeout=120)
    assert r.status_code == 200 and r.json()["via"] == "shm" and r.json()["imported"] > 0, r.text
    remote = httpx.post(d + "/v1/chat/completions", json=body, headers={HANDOFF: r.json()["handoff"]}, timeout=120)
    local = httpx.post(pd["colocated"].url + "/v1/chat/completions", json=body, timeout=120)
    assert remote.json()["choices"][0]["message"] == local.json()["choices"][0]["message"]
    assert remote.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == r.json()["prompt_tokens"]
    no_blocks_held(pd["private"])


def test_an_unreachable_decode_worker_is_a_clean_502(pd):
    r = remote_prefill(pd["prefill"].url, "http://127.0.0.1:9", chat("Nobody listens there."), timeout=60)
    assert r.status_code == 502 and "failed" in r.text
    no_blocks_held(pd["prefill"])


def test_a_reservation_holds_blocks_until_its_lease_expires(pd):
    d = pd["decode"].url
    lease = reserve(d, list(range(3000, 3064)), lease_s=0.05)
    assert [b >= 0 for b in lease["blocks"]] == [True] * 4 and lease["pool"]["num_layers"] == 30
    assert held(pd["decode"]) > 0.0
    no_blocks_held(pd["decode"])  # expired (after its grace): freed unregistered
    r = httpx.post(d + "/pd/commit", json={"lease": lease["lease"]})
    assert r.status_code == 409  # too late: nothing is imported
    assert pd["decode"].metrics()["fleetllm:kv_transfer_failures_total"] >= 1


def test_a_reservation_ends_when_its_writer_process_is_gone(pd):
    d = pd["decode"].url
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    reserve(d, list(range(4000, 4064)), lease_s=600, pid=gone.pid, pid_ns=pid_namespace())
    no_blocks_held(pd["decode"])  # long before the lease's 600 s


def test_a_released_reservation_frees_its_blocks_and_cannot_be_committed(pd):
    d = pd["decode"].url
    lease = reserve(d, list(range(5000, 5064)), pid=os.getpid(), pid_ns=pid_namespace())
    assert httpx.post(d + "/pd/release", json={"lease": lease["lease"]}).json() == {"released": True}
    assert held(pd["decode"]) == 0.0
    assert httpx.post(d + "/pd/commit", json={"lease": lease["lease"]}).status_code == 409


@pytest.mark.parametrize("end", ["release", "writer gone"])
def test_a_commit_with_keep_holds_the_blocks_registered_until_the_writer_releases_them(pd, end):
    d, tokens = pd["decode"].url, list(range(5100 + (end != "release") * 100, 5164 + (end != "release") * 100))
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease = reserve(d, tokens, pid=writer.pid, pid_ns=pid_namespace())
        r = httpx.post(d + "/pd/commit", json={"lease": lease["lease"], "keep": True})
        assert r.status_code == 200 and r.json()["kept"] == r.json()["imported"] == 4, r.text
        time.sleep(0.6)  # past two of the leases' watch ticks
        assert held(pd["decode"]) > 0.0  # kept for the writer to read back
        if end == "release":
            assert httpx.post(d + "/pd/release", json={"lease": lease["lease"]}).json() == {"released": True}
    finally:
        writer.kill()
        writer.wait()
    no_blocks_held(pd["decode"], 10.0)  # released, or its writer gone: within a tick (not at KEEP_S)
    assert len(pd["decode"].worker.engine.kv.cached_prefix(tokens)[0]) == 4  # registered all along


def test_a_prompt_computed_in_place_is_read_back_into_the_prefill_workers_prefix_cache(pd):
    p, d = pd["prefill"], pd["decode"]
    body = long_chat("Read back after the commit", pd)
    ids = p.worker.prompt_ids("chat", body)[0]
    before = len(d.worker.engine.kv.cached_prefix(ids)[0])  # the chat template's first blocks, from other tests
    r = remote_prefill(p.url, d.url, body, timeout=120)
    assert r.status_code == 200 and r.json()["in_place"] and r.json()["read_back_s"] > 0, r.text
    here, _ = p.worker.engine.kv.cached_prefix(ids)
    there, _ = d.worker.engine.kv.cached_prefix(ids)
    assert len(here) == len(there) == len(ids) // 16  # every full block, on both sides
    # the blocks computed in the decode pool, byte for byte here too
    for (pk, pv), (dk, dv) in zip(p.worker.engine.kv_blocks(), d.worker.engine.kv_blocks(), strict=True):
        assert torch.equal(pk[here[before:]], dk[there[before:]]) and torch.equal(pv[here[before:]], dv[there[before:]])
    httpx.post(d.url + "/v1/chat/completions", json=body, headers={HANDOFF: r.json()["handoff"]}, timeout=120)
    no_blocks_held(d)  # the read's reference dropped too
    no_blocks_held(p)


def test_a_client_gone_mid_prefill_leaves_no_block_held(pd):
    p, d = pd["prefill"].url, pd["decode"].url
    body = chat("Abandoned before its KV is written: " + "a long log line about a restarted worker; " * 60)
    with pytest.raises(httpx.TimeoutException):
        remote_prefill(p, d, body, timeout=0.3)  # the lease is taken as the prefill starts
    no_blocks_held(pd["prefill"])  # it notices within 0.5 s, aborts, and releases the lease
    no_blocks_held(pd["decode"])


def long_chat(topic: str, pd: dict) -> dict:
    """A chat whose prompt is longer than one step's token budget on the prefill worker: prefilled in chunks."""
    body = chat(f"{topic}: " + "a long log line about a worker that restarted and came back; " * 25)
    budget = pd["prefill"].worker.engine.config.max_num_batched_tokens
    assert len(pd["prefill"].worker.prompt_ids("chat", body)[0]) > budget
    return body


def test_a_long_prompt_computes_its_first_chunk_while_the_reservation_is_answered(pd):
    p, d = pd["prefill"].url, pd["decode"].url
    body = long_chat("Reserved while the first chunk computes", pd)
    r = remote_prefill(p, d, body, timeout=120)
    assert r.status_code == 200 and r.json()["via"] == "pool" and r.json()["reserved_during_prefill"], r.text
    assert r.json()["in_place"]  # computed in the decode pool: the first chunk, computed here, copied there first
    remote = httpx.post(d + "/v1/chat/completions", json=body, headers={HANDOFF: r.json()["handoff"]}, timeout=120)
    local = httpx.post(pd["colocated"].url + "/v1/chat/completions", json=body, timeout=120)
    assert remote.json()["choices"][0]["message"] == local.json()["choices"][0]["message"]
    assert remote.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == r.json()["prompt_tokens"]
    no_blocks_held(pd["decode"])
    no_blocks_held(pd["prefill"])


def test_a_long_prompt_refused_a_reservation_goes_as_a_frame_from_the_chunks_already_computed(pd):
    p, d = pd["prefill"].url, pd["private"].url
    body = long_chat("A private pool: the frame takes over the prefill that started before the refusal", pd)
    r = remote_prefill(p, d, body, timeout=120)
    assert r.status_code == 200 and r.json()["via"] == "shm", r.text
    remote = httpx.post(d + "/v1/chat/completions", json=body, headers={HANDOFF: r.json()["handoff"]}, timeout=120)
    local = httpx.post(pd["colocated"].url + "/v1/chat/completions", json=body, timeout=120)
    assert remote.json()["choices"][0]["message"] == local.json()["choices"][0]["message"]
    assert remote.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == r.json()["prompt_tokens"]
    no_blocks_held(pd["private"])
    no_blocks_held(pd["prefill"])


def test_a_reservation_answered_after_the_prompt_was_computed_has_it_prefilled_again(pd, monkeypatch):
    from fleetllm.disagg import direct

    engine, real = pd["prefill"].worker.async_engine, direct.reserve

    async def late(*args: object, **kw: object) -> object:  # answered once the early prefill has sampled
        seen, end = False, time.monotonic() + 60
        while time.monotonic() < end:
            pending = await engine.call(lambda e: any(e.prompt_pending(r) for r in e.seqs if r.startswith("pd-late-")))
            if seen and not pending:
                break
            seen = seen or pending
            await asyncio.sleep(0.01)
        return await real(*args, **kw)

    monkeypatch.setattr(direct, "reserve", late)
    body = long_chat("Reserved too late for the first chunk", pd)
    r = httpx.post(pd["prefill"].url + "/pd/prefill", json={"path": "/v1/chat/completions", "body": body,
                   "decode_url": pd["decode"].url, "transfer": "shm", "request_id": "late-reservation"}, timeout=120)
    assert r.status_code == 200 and r.json()["via"] == "pool" and not r.json()["reserved_during_prefill"], r.text
    assert r.json()["in_place"]  # the prefix hits here copied into the decode pool, the last block computed there
    remote = httpx.post(pd["decode"].url + "/v1/chat/completions", json=body, headers={HANDOFF: r.json()["handoff"]},
                        timeout=120)
    local = httpx.post(pd["colocated"].url + "/v1/chat/completions", json=body, timeout=120)
    assert remote.json()["choices"][0]["message"] == local.json()["choices"][0]["message"]
    no_blocks_held(pd["decode"])
    no_blocks_held(pd["prefill"])


def test_a_decode_workers_pool_file_goes_when_it_stops(worker_factory, pd):
    assert pd["prefill"].worker.engine.kv_pool_file() is None  # only decode workers share theirs (auto)
    w = worker_factory("--role", "decode")
    path = w.worker.engine.kv_pool_file().path
    assert path.exists() and path.name.startswith(f"{POOL_PREFIX}{os.getpid()}-")
    w.stop()
    assert not path.exists()


def test_pool_files_of_workers_no_longer_running_are_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale, live = tmp_path / f"{POOL_PREFIX}{gone.pid}-x", tmp_path / f"{POOL_PREFIX}{os.getpid()}-y"
    stale.write_bytes(b"0")
    live.write_bytes(b"0")
    remove_stale_pools(tmp_path)
    assert not stale.exists() and live.exists()


def _target(pool_dtype: torch.dtype, blocks: list[int], deadline: float, pool_blocks: int = 8) -> PoolTarget:
    header = FrameHeader.parse(header_for(list(range(16 * len(blocks)))))
    shape = (pool_blocks, 16, 3, 64)
    pool = [(torch.zeros(shape, dtype=pool_dtype), torch.zeros(shape, dtype=pool_dtype)) for _ in range(30)]
    return PoolTarget(header, pool, blocks, deadline)


def test_a_pool_target_writes_its_blocks_in_the_pools_dtype_and_skips_the_rest():
    t = _target(torch.float16, [5, -1, 6, 2], time.monotonic() + 60)
    k, v = torch.randn(4, 16, 3, 64), torch.randn(4, 16, 3, 64)
    t.put(3, 0, k, v, torch.tensor([3, 2, 1, 0]))  # prompt blocks 0..3 are this pool's 3, 2, 1, 0
    pk, pv = t.pool[3]
    assert torch.equal(pk[5], k[3].half()) and torch.equal(pk[6], k[1].half()) and torch.equal(pv[2], v[0].half())
    assert pk[[0, 1, 3, 4, 7]].abs().sum() == 0  # block 1 of the prompt (-1) and every other block untouched
    assert t.nbytes == 2 * 30 * 3 * 16 * 3 * 64 * 2
    t.finish()


def test_a_pool_target_writes_scattered_pool_blocks_in_one_indexed_copy_each():
    blocks = [2 * j if j % 3 else -1 for j in range(24)]  # 16 runs of one block, every third skipped
    t = _target(torch.float32, blocks, time.monotonic() + 60, pool_blocks=48)
    k, v = torch.randn(30, 16, 3, 64), torch.randn(30, 16, 3, 64)
    index = torch.arange(29, 5, -1)  # prompt block j is at 29 - j in the source
    t.put(0, 0, k, v, index)
    pk, pv = t.pool[0]
    for j, b in enumerate(blocks):
        if b >= 0:
            assert torch.equal(pk[b], k[29 - j]) and torch.equal(pv[b], v[29 - j])
    assert pk[1::2].abs().sum() == 0 and pk[[0, 6, 12]].abs().sum() == 0


@pytest.mark.parametrize("why", ["lease_over", "closed"])
def test_a_pool_target_writes_nothing_once_its_lease_is_over_or_it_is_closed(why):
    t = _target(torch.float32, [0, 1], time.monotonic() - 1 if why == "lease_over" else time.monotonic() + 60)
    if why == "closed":
        t.close()
    t.put(0, 0, torch.ones(2, 16, 3, 64), torch.ones(2, 16, 3, 64), torch.tensor([0, 1]))
    assert t.pool[0][0].abs().sum() == 0
    with pytest.raises(FrameError):
        t.finish()  # never committed


@pytest.mark.parametrize("answer", [{"blocks": [0, 4096]}, {"blocks": [0]}, {"lease_s": "NaN"},
                                    {"pool": {"num_blocks": 128, "block_size": 8}}],
                         ids=["outside", "too-few", "lease", "layout"])
def test_a_reservation_answer_the_prompt_cannot_be_written_by_is_released_unused(answer):
    tokens = list(range(32))
    header = FrameHeader("m", 2, 3, 64, "float32", 16, tokens, hash_prefix_blocks(tokens, 16, b"m"))
    f = SharedKVFile(shm_dir(), 2 * 2 * 64 * 16 * 3 * 64 * 4)  # a real pool file: mapping it would succeed
    layout = {**PoolLayout(str(f.path), 2, 64, 16, 3, 64, "float32").to_json(), **answer.get("pool", {})}
    sent: list[str] = []

    def decode_worker(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(200, json={"lease": "l1", "lease_s": 30.0, "blocks": [0, 1], **answer, "pool": layout})

    async def run() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(decode_worker)) as client:
            return await direct.reserve(client, "http://decode", header, PoolMaps(), 30.0)

    try:
        assert asyncio.run(run()) is None and sent == ["/pd/reserve", "/pd/release"]
    finally:
        f.close()


def test_prefaulting_a_shared_pools_blocks_changes_no_byte_of_it():
    f = SharedKVFile(shm_dir(), 2 * 2 * 8 * 16 * 3 * 64 * 4)
    try:
        layout = PoolLayout(str(f.path), 2, 8, 16, 3, 64, "float32")
        maps = PoolMaps()
        k0 = maps.layers(layout)[0][0]
        k0[3].fill_(7.0)
        maps.prefault(layout, [3, 4, -1, 6])
        assert torch.equal(k0[3], torch.full_like(k0[3], 7.0)) and k0[4].abs().sum() == 0
    finally:
        f.close()


def test_prefaulting_maps_the_blocks_pages_into_this_process():
    block = 16 * 3 * 64 * 4  # 12 KiB: 3 pages per block and layer
    f = SharedKVFile(shm_dir(), 2 * 2 * 64 * block)
    try:
        layout = PoolLayout(str(f.path), 2, 64, 16, 3, 64, "float32")
        maps = PoolMaps()
        maps.layers(layout)
        before = _shared_pages()
        maps.prefault(layout, list(range(32)))  # half the pool: 4 x 32 blocks x 3 pages
        assert _shared_pages() - before >= 4 * 32 * 3
    finally:
        f.close()


def test_a_block_prefaulted_once_is_not_walked_again(monkeypatch):
    f = SharedKVFile(shm_dir(), 2 * 2 * 8 * 16 * 3 * 64 * 4)
    try:
        layout = PoolLayout(str(f.path), 2, 8, 16, 3, 64, "float32")
        maps = PoolMaps()
        maps.layers(layout)
        maps.prefault(layout, [1, 2])
        calls: list[int] = []
        real = shared_pool._libc()

        class Counting:
            def madvise(self, addr, length, advice):  # noqa: ANN001, ANN202 - libc's signature
                calls.append(length.value)
                return real.madvise(addr, length, advice)

        monkeypatch.setattr(shared_pool, "_libc", lambda: Counting())
        maps.prefault(layout, [1, 2])
        assert calls == []  # mapped already: nothing to do
        maps.prefault(layout, [2, 3])
        assert len(calls) == 2 * 2 and all(n <= 16 * 3 * 64 * 4 + 4096 for n in calls)  # block 3 alone, K and V per layer
    finally:
        f.close()


def _shared_pages() -> int:
    """Resident pages of this process backed by files (/dev/shm included): statm's third field."""
    return int(Path("/proc/self/statm").read_text().split()[2])


@pytest.mark.parametrize(("n", "used"), [(2048, 2032), (100, 96), (17, 16), (10, 10)])
def test_a_prefill_computes_only_the_blocks_the_decode_worker_will_take_from_its_cache(n, used):
    assert prefilled_tokens(list(range(n)), 16) == list(range(used))
