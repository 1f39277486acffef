"""A worker with KV tiers: a returning prompt whose blocks its small pool evicted is answered from host memory
(--kv-offload-gb), a restarted one answers its previous prompt from disk (--kv-disk-dir), and the usage counts
those tokens as cached."""

from __future__ import annotations

import httpx


def complete(url: str, ids: list[int]) -> dict:
    body = {"model": "smollm2-135m", "prompt": ids, "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_returning_prompt_evicted_from_the_pool_is_cached_tokens_from_the_host_tier(worker_factory) -> None:
    w = worker_factory("--num-blocks", "24", "--max-num-batched-tokens", "128", "--kv-offload-gb", "0.05")
    first = [(7919 + 31 * i) % 3000 + 100 for i in range(100)]
    complete(w.url, first)
    for k in range(4):  # 7 blocks each: the first prompt's blocks are reused
        complete(w.url, [(k * 104729 + 17 * i) % 3000 + 100 for i in range(100)])
    again = complete(w.url, first)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # its 6 full blocks, none recomputed
    assert w.metrics()["fleetllm:kv_tier_hits_total"] > 0


def test_a_restarted_worker_answers_its_previous_prompt_from_its_disk_tier(worker_factory, tmp_path) -> None:
    flags = ("--kv-disk-dir", str(tmp_path), "--kv-disk-gb", "0.01")
    ids = [(104723 + 29 * i) % 3000 + 100 for i in range(100)]
    before = worker_factory(*flags)
    first = complete(before.url, ids)
    before.stop()  # its shutdown finishes the queued writes
    after = complete(worker_factory(*flags).url, ids)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert after["choices"][0]["text"] == first["choices"][0]["text"]
