"""A batch runner stopped mid-batch (a router restarting) and a new one over the same directory (or S3 prefix):
every line answered exactly once, the lines answered before the stop never sent again."""

from __future__ import annotations

import asyncio
import gc
import json
import stat
import time

from fleetllm.router.batches.lines import jsonl
from fleetllm.router.batches.runner import BatchRunner, drain
from fleetllm.router.batches.store import OWNER, BatchStore, open_store

LINES = 10


def make_batch(store: BatchStore) -> dict:
    data = jsonl([{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": str(i)}}
                  for i in range(LINES)])
    store.put_file({"id": "file-in", "purpose": "batch", OWNER: "k"}, data)
    batch = {"id": "batch-1", "input_file_id": "file-in", "endpoint": "/v1/completions", "status": "validating",
             "expires_at": time.time() + 3600, "request_counts": {}, OWNER: "k"}
    store.save("batches", batch)
    return batch


async def stop_after(store: BatchStore, answered: int) -> list[str]:
    """Run a batch until ``answered`` lines are done and the next ones hang in flight, then stop the runner."""
    sent: list[str] = []

    async def call(path: str, body: dict, owner: str) -> tuple[int, dict, str]:
        sent.append(body["prompt"])
        if len(sent) > answered:
            await asyncio.Event().wait()  # in flight when the router stops: never answered
        return 200, {"text": body["prompt"]}, "r"

    runner = BatchRunner(store, call, concurrency=2)
    runner.submit(make_batch(store))
    while len(sent) < answered + 2:
        await asyncio.sleep(0.01)
    await runner.stop()
    return sent


async def resume(store: BatchStore) -> list[str]:
    sent: list[str] = []

    async def call(path: str, body: dict, owner: str) -> tuple[int, dict, str]:
        sent.append(body["prompt"])
        return 200, {"text": body["prompt"]}, "r"

    runner = BatchRunner(store, call, concurrency=2)
    runner.start()
    await drain(runner)
    return sent


def test_a_resumed_batch_answers_every_line_once_and_resends_only_unanswered_ones(tmp_path):
    store = BatchStore(tmp_path / "batches")
    before = asyncio.run(stop_after(store, answered=4))
    after = asyncio.run(resume(store))
    batch = store.load("batches", "batch-1")
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": LINES, "completed": LINES,
                                                                          "failed": 0}
    out = [json.loads(ln) for ln in store.file_data(batch["output_file_id"]).splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(LINES))
    assert not set(before[:4]) & set(after) and sorted(before[:4] + after) == sorted(map(str, range(LINES)))


def test_the_batch_directory_is_private_to_the_routers_user(tmp_path):
    store = BatchStore(tmp_path / "batches")
    make_batch(store)
    for d in (store.root, store.root / "files", store.root / "batches"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in (*store.root.glob("files/*"), *store.root.glob("batches/*")):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_a_batch_kept_in_s3_resumes_on_a_new_router_answering_every_line_once(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3_server.client("s3").create_bucket(Bucket="fleetllm-batches")
    where = "s3://fleetllm-batches/router-1"
    before = asyncio.run(stop_after(open_store(where), answered=4))
    store = open_store(where)  # a restarted router: nothing but what the bucket holds
    after = asyncio.run(resume(store))
    batch = open_store(where).load("batches", "batch-1")
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == LINES
    out = [json.loads(ln) for ln in store.file_data(batch["output_file_id"]).splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(LINES))
    assert not set(before[:4]) & set(after) and sorted(before[:4] + after) == sorted(map(str, range(LINES)))
    store.drop_batch("batch-1")
    store.delete_file("file-in")
    assert open_store(where).all("batches") == [] and open_store(where).load("files", "file-in") is None


def test_a_runner_stopped_while_its_calls_fail_on_the_way_out_leaves_no_error_unretrieved(tmp_path):
    # a stopping router closes its client: the lines in flight fail with its error rather than end cancelled
    async def stopped() -> list[str]:
        unretrieved: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx["message"]))
        sent: list[str] = []

        async def call(path: str, body: dict, owner: str) -> tuple[int, dict, str]:
            sent.append(body["prompt"])
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise ConnectionError("the router's client closed") from None
            return 200, {}, "r"

        runner = BatchRunner(BatchStore(tmp_path / "batches"), call, concurrency=2)
        runner.submit(make_batch(runner.store))
        while len(sent) < 2:
            await asyncio.sleep(0.01)
        await runner.stop()
        gc.collect()  # an unretrieved future reports when it is collected
        await asyncio.sleep(0)
        return unretrieved

    assert asyncio.run(stopped()) == []
