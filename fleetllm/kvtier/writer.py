"""The background writer of the disk and shared tiers: stores never run on the engine's step.

The engine thread hands over a block already copied out of the pool (:meth:`Writer.submit`, which never
blocks: past ``max_pending_bytes`` queued, a block is dropped, costing a future hit, not host memory); one daemon thread encodes it and hands the bytes
to the tier's ``put``. A ``put`` that raises is logged and counted; the thread goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from fleetllm.kvtier.codec import encode
from fleetllm.kvtier.host import HostBlock
from fleetllm.kvtier.remote import Unavailable

log = logging.getLogger("fleetllm.kvtier")

Put = Callable[[int, bytes], None]  # (block hash, stored bytes)


class Writer:
    """One thread writing blocks through ``put``; ``on_error`` counts a failed write, ``on_written`` is told a
    done one (its hash, the block, the bytes written)."""

    def __init__(self, name: str, put: Put, on_error: Callable[[], None],
                 on_written: Callable[[int, HostBlock, int], None],
                 max_pending_bytes: int = 256 * 2**20) -> None:
        self._put, self._on_error, self._on_written = put, on_error, on_written
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # blocks queued and not yet written (both threads: under _lock)
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, HostBlock] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kvtier-writer-{name}", daemon=True)
        self._thread.start()

    def submit(self, block_hash: int, block: HostBlock) -> bool:
        """Queue ``block`` for writing (False: the queue is full, the block is not written)."""
        with self._lock:
            if self._pending_bytes + block.nbytes > self.max_pending_bytes:
                return False
            self._pending_bytes += block.nbytes
        self._queue.put_nowait((block_hash, block))
        return True

    def flush(self) -> None:
        """Wait until every block submitted so far is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            block_hash, block = item
            try:
                data = encode(block)
                self._put(block_hash, data)
                self._on_written(block_hash, block, len(data))
            except Unavailable:  # the store failed a moment ago (logged then): counted only
                self._on_error()
            except Exception as e:  # noqa: BLE001 - a failed write costs a hit, never the engine
                log.warning("KV tier: writing block %016x failed (%s)", block_hash, e)
                self._on_error()
            finally:
                with self._lock:
                    self._pending_bytes -= block.nbytes
                self._queue.task_done()
        self._queue.task_done()
