"""Scale from zero: requests for a model with no ready copy wait in the router while one starts.

The queue is bounded per model and each request waits at most ``timeout_s``; past either bound the client
gets a 503 with ``Retry-After`` at once, so nothing hangs. ``waiting`` is what the fleet controller reads
(``/router/state``'s ``held``) to start a copy of a model that has none; ``ready(model)`` wakes the model's
waiters when a copy of it becomes routable.
"""

from __future__ import annotations

import asyncio
import time

from fleetllm.server.protocol import APIError


class ColdStartHold:
    def __init__(self, max_waiting: int = 64, timeout_s: float = 120.0, retry_after_s: int = 10) -> None:
        self.max_waiting, self.timeout_s, self.retry_after_s = max_waiting, timeout_s, retry_after_s
        self.waiting: dict[str, int] = {}
        self._events: dict[str, asyncio.Event] = {}

    async def wait(self, model: str) -> float:
        """Wait until ``ready(model)``; return the seconds waited. Raises a 503 ``APIError`` past a bound."""
        if self.waiting.get(model, 0) >= self.max_waiting:
            raise self._refusal(model, f"{self.max_waiting} requests already wait for a copy of it to start")
        event = self._events.setdefault(model, asyncio.Event())
        self.waiting[model] = self.waiting.get(model, 0) + 1
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(event.wait(), self.timeout_s)
        except TimeoutError:
            raise self._refusal(model, f"no copy of it was ready within {self.timeout_s:g}s") from None
        finally:
            self.waiting[model] -= 1
        return time.monotonic() - t0

    def ready(self, model: str) -> None:
        """A copy of ``model`` is routable: release every request held for it."""
        event = self._events.pop(model, None)
        if event is not None:
            event.set()

    def _refusal(self, model: str, why: str) -> APIError:
        return APIError(503, f"model `{model}` is starting: {why}; retry later", "model",
                        headers={"Retry-After": str(self.retry_after_s)})
