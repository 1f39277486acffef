"""Each batch's lines through the router's own request path, at the lowest priority, a few at a time.

A line is done once its result (output or error line) is appended to the batch's ``.done`` record; a
restarted runner reads that record and sends only the lines not in it, so no line is lost or answered twice
(a line in flight when the router stopped is sent again: its first answer was never recorded).

Lines hold one of ``concurrency`` slots shared by every batch, so batches fill the fleet's idle capacity and
never crowd it: each body carries ``priority`` (the largest, by default), which fleetllm workers under
``--scheduling-policy priority`` serve after every interactive request. A line refused for load (429, 503) is
retried until the batch's window closes; past it the batch is ``expired`` and its unsent lines error lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fleetllm.router.batches.lines import Line, error_line, jsonl, output_line, parse_lines
from fleetllm.router.batches.store import OWNER, BatchStore, new_id

log = logging.getLogger(__name__)

# (path, body, owner key id) -> (status, response body as JSON, request id)
Call = Callable[[str, dict[str, Any], str], Awaitable[tuple[int, Any, str]]]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
RETRY = (429, 503)
LOWEST_PRIORITY = 2**31 - 1


class BatchRunner:
    """Runs the batches of ``store``; ``start`` resumes those a previous router left unfinished."""

    def __init__(self, store: BatchStore, call: Call, concurrency: int = 4, priority: int = LOWEST_PRIORITY,
                 retry_s: float = 1.0) -> None:
        self.store = store
        self.call = call
        self.priority = priority
        self.retry_s = retry_s
        self.slots = asyncio.Semaphore(concurrency)
        self.concurrency = concurrency
        self.live: dict[str, dict[str, Any]] = {}  # the batches running, as the API shows them
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        for batch in self.store.all("batches"):
            if batch.get("status") in ACTIVE:
                log.info("resuming batch %s (%s)", batch["id"], batch["status"])
                self.submit(batch)

    async def stop(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()

    def submit(self, batch: dict[str, Any]) -> None:
        self.live[batch["id"]] = batch
        self.tasks[batch["id"]] = asyncio.create_task(self._run(batch), name=f"batch-{batch['id']}")

    def view(self, batch_id: str) -> dict[str, Any] | None:
        """The batch as it is now (its running copy while it runs)."""
        return self.live.get(batch_id) or self.store.load("batches", batch_id)

    def cancel(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Stop sending ``batch``'s lines; those in flight finish, then it is ``cancelled``."""
        live = self.live.get(batch["id"])
        if live is None or live["status"] not in ACTIVE:
            return live or batch
        live["status"] = "cancelling"
        live["cancelling_at"] = int(time.time())
        self.store.save("batches", live)
        return live

    async def _run(self, batch: dict[str, Any]) -> None:
        try:
            data = await asyncio.to_thread(self.store.file_data, batch["input_file_id"])
            if data is None:
                return self._fail(batch, "input_file_missing", "the input file was deleted before the batch ran")
            lines = await asyncio.to_thread(parse_lines, data, batch["endpoint"])
            if batch["status"] == "validating":
                batch.update(status="in_progress", in_progress_at=int(time.time()))
                self.store.save("batches", batch)
            done = await asyncio.to_thread(self.store.done, batch["id"])
            counts = batch["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
            for ok, _ in done.values():
                counts["completed" if ok else "failed"] += 1
            todo = [line for line in lines if line.index not in done]
            for line in todo:
                if line.error is not None:
                    await self._record(batch, line, False, error_line(line.custom_id, *line.error))
            await self._send_until_window(batch, [line for line in todo if line.error is None])
            await self._finalize(batch, lines)
        finally:
            self.live.pop(batch["id"], None)
            self.tasks.pop(batch["id"], None)

    async def _send_until_window(self, batch: dict[str, Any], lines: list[Line]) -> None:
        """Send ``lines`` (``concurrency`` senders) until all are done, the batch is cancelled or its window ends."""
        queue = iter(lines)

        async def sender() -> None:
            for line in queue:
                if batch["status"] != "in_progress":
                    return
                await self._send(batch, line)

        left = batch["expires_at"] - time.time()
        senders = [asyncio.create_task(sender()) for _ in range(min(self.concurrency, len(lines)))]
        try:
            # not wait_for(gather(...)): a gather cancelled with the runner (a router stopping mid-batch) took the
            # error a sender raised while cancelled and logged "exception was never retrieved"
            done, pending = await asyncio.wait(senders, timeout=max(left, 0.0), return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t.exception() for t in done if not t.cancelled() and t.exception() is not None), None)
            if failed is not None:
                raise failed
            if pending and batch["status"] == "in_progress":
                batch["status"] = "expiring"  # (internal) no more lines go; the finalizer names it expired
        finally:
            for s in senders:
                s.cancel()
            await asyncio.gather(*senders, return_exceptions=True)

    async def _send(self, batch: dict[str, Any], line: Line) -> None:
        assert line.body is not None
        body = {**line.body, "priority": self.priority}
        while True:
            async with self.slots:
                status, answer, request_id = await self.call(batch["endpoint"], body, batch[OWNER])
            if status not in RETRY or batch["status"] != "in_progress":
                break
            await asyncio.sleep(self.retry_s)  # the fleet (or the key's limit) is full: interactive traffic first
        if status in RETRY:
            return  # cancelled or expiring while refused: the line was never answered
        await self._record(batch, line, 200 <= status < 300, output_line(line.custom_id, status, request_id, answer))

    async def _record(self, batch: dict[str, Any], line: Line, ok: bool, result: dict[str, Any]) -> None:
        # durable before it counts: an fsync, or a PUT to S3, off the event loop
        await asyncio.to_thread(self.store.append_done, batch["id"], line.index, ok, result)
        batch["request_counts"]["completed" if ok else "failed"] += 1

    async def _finalize(self, batch: dict[str, Any], lines: list[Line]) -> None:
        """Write the output and error files from the finished lines; the batch's final status."""
        cancelled = batch["status"] == "cancelling"
        expired = batch["status"] == "expiring"
        batch["status"] = "finalizing"
        batch["finalizing_at"] = int(time.time())
        self.store.save("batches", batch)
        done = await asyncio.to_thread(self.store.done, batch["id"])
        if expired:
            for line in lines:
                if line.index not in done:
                    result = error_line(line.custom_id, "batch_expired", "the batch's completion window ended first")
                    await self._record(batch, line, False, result)
            done = await asyncio.to_thread(self.store.done, batch["id"])
        ordered = [done[i] for i in sorted(done)]
        outputs = [line for _, line in ordered if line["response"] is not None]
        errors = [line for _, line in ordered if line["response"] is None]
        batch["output_file_id"] = await self._result_file(batch, outputs, "output")
        batch["error_file_id"] = await self._result_file(batch, errors, "error")
        final = "cancelled" if cancelled else "expired" if expired else "completed"
        batch.update(status=final, **{f"{final}_at": int(time.time())})
        self.store.save("batches", batch)

    async def _result_file(self, batch: dict[str, Any], lines: list[dict[str, Any]], kind: str) -> str | None:
        if not lines:
            return None
        data = jsonl(lines)
        meta = {"id": new_id("file"), "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": f"{batch['id']}_{kind}.jsonl", "purpose": "batch_output", "status": "processed",
                "expires_at": batch.get("retain_until"), OWNER: batch[OWNER]}
        await asyncio.to_thread(self.store.put_file, meta, data)
        return meta["id"]

    def _fail(self, batch: dict[str, Any], code: str, message: str) -> None:
        batch.update(status="failed", failed_at=int(time.time()),
                     errors={"object": "list", "data": [{"code": code, "message": message, "line": None,
                                                         "param": "input_file_id"}]})
        self.store.save("batches", batch)


async def drain(runner: BatchRunner) -> None:
    """Wait for every running batch to end."""
    while runner.tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*list(runner.tasks.values()), return_exceptions=True)
