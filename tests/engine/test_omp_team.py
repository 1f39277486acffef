"""One OpenMP team per worker: the helpers that keep a worker's parallel work on its engine thread."""

from __future__ import annotations

import threading

import pytest
import torch

from fleetllm.engine.omp_team import make_serial, run_on_passing_thread, serial_executor


def test_passing_thread_returns_the_result_from_another_thread() -> None:
    assert run_on_passing_thread(threading.get_ident) != threading.get_ident()


def test_passing_thread_raises_the_error_in_the_caller() -> None:
    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        run_on_passing_thread(fail)


def test_serial_threads_run_alone_and_leave_the_others_alone() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with serial_executor("t") as ex:
            inside = ex.submit(torch.get_num_threads).result()
            total = ex.submit(lambda: torch.ones(1 << 20).sum().item()).result()  # a parallel-sized op
        assert inside == 1  # libgomp found and this thread's regions run on it alone
        assert total == 1 << 20
        assert torch.get_num_threads() == 2  # the calling thread keeps its team
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [2]  # a thread made serial does not change what new threads get
    finally:
        torch.set_num_threads(before)


def test_make_serial_is_idempotent() -> None:
    seen: list[int] = []

    def run() -> None:
        make_serial()
        make_serial()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [1]
