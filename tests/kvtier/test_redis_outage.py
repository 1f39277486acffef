"""Redis killed under two real workers sharing it as their KV tier: requests in flight and after are answered
(their blocks computed), each worker says ``fleetllm:kv_tier_degraded``; Redis back (same port, empty), the
next prompt one worker computes is a hit for the other again and the gauge returns to 0."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from fleetllm.fleet.redis_server import RedisServer
from tests.kvtier.tier_helpers import FULL_BLOCKS, complete, prompt


def test_redis_killed_mid_run_fails_no_request_and_hits_return_once_it_is_back(worker_factory) -> None:
    store = RedisServer().start()  # this test's own: it kills it
    try:
        a, b = (worker_factory("--kv-remote", store.url) for _ in range(2))
        with ThreadPoolExecutor(4) as pool:  # requests in flight on both workers as Redis dies
            answers = [pool.submit(complete, w.url, prompt(300 + k)) for k, w in enumerate([a, b] * 3)]
            store.kill()
            answers = [f.result() for f in answers]  # complete() asserts each answered 200
        for k, w in enumerate([a, b]):  # and after: computed, not refused
            complete(w.url, prompt(400 + k))
        assert a.metrics()["fleetllm:kv_tier_degraded"] == b.metrics()["fleetllm:kv_tier_degraded"] == 1
        store.start()  # back on the same port, empty
        cached, end = 0, time.monotonic() + 30
        while cached != FULL_BLOCKS and time.monotonic() < end:  # until a's writes reach Redis again
            ids = prompt(500 + int(time.monotonic() * 1000) % 10_000)
            complete(a.url, ids)
            time.sleep(0.3)  # a's background write of the finished request's blocks
            cached = complete(b.url, ids)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == FULL_BLOCKS
        assert a.metrics()["fleetllm:kv_tier_degraded"] == b.metrics()["fleetllm:kv_tier_degraded"] == 0
    finally:
        store.stop()
