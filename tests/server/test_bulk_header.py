"""``x-fleetllm-bulk`` (set by a router's flow control on bulk work): a worker under ``--scheduling-policy priority``
serves such a request a level less urgent, so a request of the priority it asked for takes its batch slot at once
instead of waiting for it to end. A simulated worker of one batch slot; the order the two requests end in."""

from __future__ import annotations

import threading

import httpx
from fleet_helpers import sim_workers

from fleetllm.server.protocol import BULK_HEADER, PRIORITY_MAX, bulk_priority


def test_a_request_marked_bulk_gives_its_batch_slot_to_one_of_the_priority_it_asked():
    sims = sim_workers(1, "--scheduling-policy", "priority", "--max-num-seqs", "1")
    try:  # unmarked, the long request would end first (the short one waiting for its slot)
        assert ends_first(sims.url + "/v1/completions", {BULK_HEADER: "1"}) == "urgent"
    finally:
        sims.stop()


def ends_first(url: str, headers: dict[str, str]) -> str:
    """Which ends first: a long request sent with ``headers``, or a short one sent once the long one runs."""
    done: list[str] = []
    started = threading.Event()

    def long() -> None:
        body = {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
            for _ in r.iter_lines():
                started.set()  # running: it holds the one slot
        done.append("long")

    t = threading.Thread(target=long)
    t.start()
    assert started.wait(30)
    r = httpx.post(url, json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2}, timeout=60)
    done.append("urgent")
    t.join(60)
    assert r.status_code == 200
    return done[0]


def test_bulk_work_is_one_priority_level_less_urgent_and_never_past_the_range():
    assert (bulk_priority(0), bulk_priority(-7), bulk_priority(PRIORITY_MAX)) == (1, -6, PRIORITY_MAX)
