"""One OpenMP team per worker process: why a worker's parallel work all runs on its engine thread.

libgomp, the OpenMP runtime that torch ships and fleetllm's C kernels share, gives every thread that starts a
parallel region a pool of its own worker threads, kept until that thread exits. Once a process holds more
OpenMP-managed threads than it has cores, libgomp lets a parked worker spin only 100 times (instead of
~300,000) before it sleeps, so every parallel region has to wake its workers through the kernel. A decode step
at batch 1 is hundreds of short regions: on 2 cores, with the model loaded on the main thread and decoded on the
engine thread, a Q4 GEMV took 80-114 us instead of 23-42 us and the worker ran 34-37 tok/s where the same
engine in one thread ran 57-61 (git log -p BENCHMARKS.md: "One OpenMP team per worker").

So a worker builds its engine on a thread that ends once it is built (its pool goes with it), warms it up on the
engine thread, and every other thread that touches tensors runs its parallel regions alone (:func:`make_serial`),
which costs nothing for what they do: memory-bound copies.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import sys
import threading
from collections.abc import Callable
from functools import cache
from typing import TypeVar

T = TypeVar("T")


def run_on_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that ends when it returns, so no OpenMP pool of its outlives it; its result,
    or its exception raised here."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="engine-build")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


@cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """libgomp's ``omp_set_num_threads``: the copy torch loaded (the same soname resolves to it); None without."""
    try:
        return ctypes.CDLL("libgomp.so.1").omp_set_num_threads
    except (OSError, AttributeError):
        return None


def make_serial() -> None:
    """Let the calling thread's parallel regions run on it alone, starting no OpenMP pool of its own. Nothing to
    do in a process without torch: the simulated worker shares the server (and its thread pool) but never loads
    it, and importing it here cost each simulated worker process ~1 s of CPU at its first request."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.get_num_threads()  # torch's per-thread set-up first: it sets this thread's OpenMP thread count itself
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


def serial_executor(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads run parallel regions alone (see :func:`make_serial`)."""
    return concurrent.futures.ThreadPoolExecutor(thread_name_prefix=name, initializer=make_serial)
