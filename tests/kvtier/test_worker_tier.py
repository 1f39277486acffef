"""A worker with KV tiers: a returning prompt whose blocks its small pool evicted is answered from host memory
(--kv-offload-gb), a restarted one answers its previous prompt from disk (--kv-disk-dir), and the usage counts
those tokens as cached."""

from __future__ import annotations

import httpx

from tests.kvtier.tier_helpers import complete


def test_a_returning_prompt_evicted_from_the_pool_is_cached_tokens_from_the_host_tier_at_a_reported_load_time(
        worker_factory) -> None:
    w = worker_factory("--num-blocks", "24", "--max-num-batched-tokens", "128", "--kv-offload-gb", "0.05")
    first = [(7919 + 31 * i) % 3000 + 100 for i in range(100)]
    complete(w.url, first)
    for k in range(4):  # 7 blocks each: the first prompt's blocks are reused
        complete(w.url, [(k * 104729 + 17 * i) % 3000 + 100 for i in range(100)])
    again = complete(w.url, first)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # its 6 full blocks, none recomputed
    assert w.metrics()["fleetllm:kv_tier_hits_total"] > 0
    snapshot, _ = tier_events(w.url, (), want=0)  # its load report: what a router prices the host tier's blocks at
    assert 0.0 < snapshot["tier_load_s"]["CPU"] < 1.0 and set(snapshot["tier_load_s"]) == {"CPU"}


def test_a_restarted_worker_answers_its_previous_prompt_from_its_disk_tier(worker_factory, tmp_path) -> None:
    flags = ("--kv-disk-dir", str(tmp_path), "--kv-disk-gb", "0.01")
    ids = [(104723 + 29 * i) % 3000 + 100 for i in range(100)]
    before = worker_factory(*flags)
    first = complete(before.url, ids)
    before.stop()  # its shutdown finishes the queued writes
    after = complete(worker_factory(*flags).url, ids)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert after["choices"][0]["text"] == first["choices"][0]["text"]


def tier_events(url: str, media: tuple[str, ...], want: int) -> tuple[dict, dict[str, list[int]]]:
    """A fresh /kv/events stream's snapshot, and the tier blocks its events then stored, by medium: read until
    each of ``media`` has ``want`` of them (or 30 s pass)."""
    import json
    import time

    stored: dict[str, list[int]] = {m: [] for m in media}
    end = time.monotonic() + 30
    with httpx.stream("GET", url + "/kv/events", timeout=httpx.Timeout(10.0)) as r:
        lines = (json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: "))
        snapshot = next(lines)
        while any(len(v) < want for v in stored.values()) and time.monotonic() < end:
            ev = next(lines)
            if ev["type"] == "stored" and "medium" in ev:
                stored.setdefault(ev["medium"], []).extend(ev["hashes"])
    return snapshot, stored


def test_the_kv_events_stream_reports_disk_and_shared_tier_blocks_with_their_medium(worker_factory, tmp_path,
                                                                                     redis_server) -> None:
    import threading

    w = worker_factory("--kv-disk-dir", str(tmp_path), "--kv-disk-gb", "0.01", "--kv-remote", redis_server.url)
    ids = [(104729 + 37 * i) % 3000 + 100 for i in range(100)]
    request = threading.Timer(0.3, complete, (w.url, ids))  # sent once the stream below has its snapshot
    request.start()
    before, stored = tier_events(w.url, ("DISK", "SHARED"), want=6)
    request.join()
    assert before["tiers"] == {"DISK": [], "SHARED": []} and before["kv_namespace"]
    assert stored["DISK"] == stored["SHARED"] and len(stored["DISK"]) == 6 and len(stored) == 2
    after, _ = tier_events(w.url, (), want=0)  # a router (re)connecting learns them from the snapshot
    assert set(after["tiers"]["DISK"]) == set(after["tiers"]["SHARED"]) == set(stored["DISK"])
