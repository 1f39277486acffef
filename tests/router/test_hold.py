"""Scale from zero: requests held while a copy starts, released when it is ready, refused past the bounds."""

from __future__ import annotations

import asyncio

import pytest

from fleetllm.router.hold import ColdStartHold
from fleetllm.server.protocol import APIError


def test_held_requests_are_released_when_a_copy_is_ready():
    async def run():
        hold = ColdStartHold(max_waiting=4, timeout_s=5)
        waiters = [asyncio.create_task(hold.wait("m")) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert hold.waiting["m"] == 3
        hold.ready("m")
        waited = await asyncio.gather(*waiters)
        assert all(w >= 0.04 for w in waited) and hold.waiting["m"] == 0
    asyncio.run(run())


def test_past_the_queue_bound_the_client_gets_503_with_retry_after_at_once():
    async def run():
        hold = ColdStartHold(max_waiting=1, timeout_s=5, retry_after_s=7)
        first = asyncio.create_task(hold.wait("m"))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as e:
            await hold.wait("m")
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "7"}
        hold.ready("m")
        await first
    asyncio.run(run())


def test_past_the_timeout_a_held_request_gets_503_and_leaves_the_queue():
    async def run():
        hold = ColdStartHold(timeout_s=0.05)
        with pytest.raises(APIError) as e:
            await hold.wait("m")
        assert e.value.status == 503 and "within 0.05s" in e.value.message
        assert hold.waiting["m"] == 0
    asyncio.run(run())


def test_ready_for_one_model_does_not_release_another():
    async def run():
        hold = ColdStartHold(timeout_s=0.2)
        other = asyncio.create_task(hold.wait("b"))
        await asyncio.sleep(0.01)
        hold.ready("a")
        with pytest.raises(APIError):
            await other
    asyncio.run(run())
