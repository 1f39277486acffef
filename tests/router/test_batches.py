"""The Batch API through the official openai client: files and batches on an in-process router over a
simulated worker, each visible to its own key alone; a router with no worker keeps a batch
running for the cancel, expiry and quota cases."""

from __future__ import annotations

import json
import time

import openai
import pytest
from fleet_helpers import ThreadServer, router, sim_workers
from test_shared_limits import upstream

from fleetllm.router.keys import KeyStore

END = ("completed", "failed", "expired", "cancelled")


def request_line(i: int, **body) -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 4, **body}})


def batch_file(n: int, malformed: tuple[int, ...] = ()) -> bytes:
    return "\n".join("{not json" if i in malformed else request_line(i) for i in range(n)).encode() + b"\n"


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def wait_for(c: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = END, deadline_s: float = 30.0):
    end = time.monotonic() + deadline_s
    while (b := c.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < end, f"batch stayed {b.status}"
        time.sleep(0.05)
    return b


def run_batch(c: openai.OpenAI, data: bytes, window: str = "24h"):
    f = c.files.create(file=("in.jsonl", data), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window,
                            metadata={"job": "test"})


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return KeyStore(tmp_path_factory.mktemp("keys") / "keys.yaml")


@pytest.fixture(scope="module")
def served(keys, tmp_path_factory):
    """A router over one simulated worker: its url."""
    workers = sim_workers(1)
    r = router(workers.urls, "round_robin", "--keys-file", str(keys.path),
               "--batch-dir", str(tmp_path_factory.mktemp("batches")))
    yield r.url
    r.stop()
    workers.stop()


@pytest.fixture(scope="module")
def idle(keys, tmp_path_factory):
    """A router with no worker (its batches wait for capacity), small files and one active batch per key."""
    r = router([], "round_robin", "--keys-file", str(keys.path), "--batch-dir", str(tmp_path_factory.mktemp("idle")),
               "--batch-max-file-mb", "0.01", "--batch-max-active", "1")
    yield r.url
    r.stop()


def test_a_file_with_malformed_lines_completes_with_an_answer_or_an_error_per_line(served, keys):
    c = client(served, keys.create()[1])
    batch = wait_for(c, run_batch(c, batch_file(20, malformed=(3, 11))).id)
    assert batch.status == "completed" and batch.metadata == {"job": "test"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (20, 18, 2)
    out = [json.loads(ln) for ln in c.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(ln) for ln in c.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(20) if i not in (3, 11))
    assert all(o["response"]["status_code"] == 200 and o["error"] is None and o["response"]["request_id"]
               and o["response"]["body"]["choices"] for o in out)
    assert [(e["response"], e["error"]["code"]) for e in errors] == [(None, "invalid_json")] * 2


def test_batch_lines_are_sent_at_the_lowest_priority(keys, tmp_path):
    app = upstream()
    with ThreadServer(app) as up:
        r = router([up.url], "round_robin", "--batch-dir", str(tmp_path))
        try:
            c = client(r.url, "unused")
            assert wait_for(c, run_batch(c, batch_file(3)).id).status == "completed"
        finally:
            r.stop()
    assert [body["priority"] for body in app.state.seen] == [2**31 - 1] * 3


def test_another_keys_files_and_batches_are_not_found(served, keys):
    mine, theirs = client(served, keys.create()[1]), client(served, keys.create()[1])
    batch = run_batch(mine, batch_file(2))
    for call in (lambda: theirs.files.retrieve(batch.input_file_id), lambda: theirs.files.content(batch.input_file_id),
                 lambda: theirs.batches.retrieve(batch.id), lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.files.delete(batch.input_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in theirs.batches.list()]
    assert batch.id in [b.id for b in mine.batches.list()]
    wait_for(mine, batch.id)


def test_listing_pages_with_after_and_limit(served, keys):
    c = client(served, keys.create()[1])
    ids = [run_batch(c, batch_file(1)).id for _ in range(3)]
    first = c.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert [b.id for b in c.batches.list(limit=2, after=first.data[-1].id).data] == ids[:1]
    for i in ids:
        wait_for(c, i)


def test_management_calls_do_not_count_toward_a_keys_rpm_limit(served, keys):
    c = client(served, keys.create(rpm_limit=1)[1])
    f = c.files.create(file=("in.jsonl", batch_file(1)), purpose="batch")
    for _ in range(3):
        c.files.retrieve(f.id)
        c.batches.list()
    assert c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices


def test_a_cancelled_batch_ends_cancelled_with_its_unsent_lines_left_out(idle, keys):
    c = client(idle, keys.create()[1])
    batch = run_batch(c, batch_file(3))
    wait_for(c, batch.id, ("in_progress",))
    assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    ended = wait_for(c, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at and ended.request_counts.completed == 0


def test_a_batch_past_its_window_expires_and_its_unfinished_lines_become_errors(idle, keys):
    c = client(idle, keys.create()[1])
    ended = wait_for(c, run_batch(c, batch_file(3), window="1s").id)
    assert ended.status == "expired" and ended.request_counts.failed == 3
    errors = [json.loads(ln) for ln in c.files.content(ended.error_file_id).text.splitlines()]
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 3


def test_a_key_past_its_active_batch_quota_gets_a_429(idle, keys):
    c = client(idle, keys.create()[1])
    first = run_batch(c, batch_file(1))
    with pytest.raises(openai.RateLimitError):
        run_batch(c, batch_file(1))
    c.batches.cancel(first.id)
    wait_for(c, first.id)


@pytest.mark.parametrize("data", [b"x" * 20_000, b"{not json\n[1]\n\n"], ids=["over_the_limit", "no_request_line"])
def test_an_upload_over_the_limit_or_without_a_request_line_is_a_400(idle, keys, data):
    with pytest.raises(openai.BadRequestError):
        client(idle, keys.create()[1]).files.create(file=("in.jsonl", data), purpose="batch")


def test_a_router_restarted_over_the_same_directory_finishes_the_batch(tmp_path):
    stalled = router([], "round_robin", "--batch-dir", str(tmp_path))  # no worker: the lines wait
    try:
        c = client(stalled.url, "unused")
        batch_id = run_batch(c, batch_file(5)).id
        wait_for(c, batch_id, ("in_progress",))
    finally:
        stalled.stop()
    workers = sim_workers(1)
    resumed = router(workers.urls, "round_robin", "--batch-dir", str(tmp_path))
    try:
        c = client(resumed.url, "unused")
        ended = wait_for(c, batch_id)
        out = [json.loads(ln) for ln in c.files.content(ended.output_file_id).text.splitlines()]
    finally:
        resumed.stop()
        workers.stop()
    assert ended.status == "completed" and ended.request_counts.completed == 5
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in range(5)]


def test_a_deleted_file_is_gone(served, keys):
    c = client(served, keys.create()[1])
    f = c.files.create(file=("in.jsonl", batch_file(1)), purpose="batch")
    assert c.files.retrieve(f.id).bytes == len(batch_file(1))
    assert c.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
