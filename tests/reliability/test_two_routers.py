"""Two routers over the same workers: each keeps the exact KV index from the workers' events, and when
one goes away the other keeps routing to the cached prefix."""

from __future__ import annotations

import httpx
from fleet_helpers import ADMIN, router, sim_workers, wait_state

SYSTEM = "You are the on-call assistant. Cite the runbook section and keep answers short. " * 4


def _chat(i: int) -> dict:
    return {"max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q{i}"}]}


def _exact(url: str) -> dict[str, list[int]]:
    state = httpx.get(url + "/router/state?hashes=1", headers=ADMIN).json()
    return {w["name"]: w["exact_hashes"] for w in state["workers"]}


def _idle(state: dict) -> bool:
    return all(w["running"] == w["waiting"] == w["queued_prefill_tokens"] == 0 for w in state["workers"])


def test_a_second_router_sees_the_same_cache_and_takes_over(procs) -> None:
    sims = sim_workers(2)
    procs.append(sims)
    a, b = router(sims.urls, "kv_aware"), router(sims.urls, "kv_aware")
    procs.extend([a, b])
    for r in (a, b):
        wait_state(r.url, lambda s: all(w["healthy"] and w["events_connected"] for w in s["workers"]))
    first = httpx.post(a.url + "/v1/chat/completions", json=_chat(0), timeout=30)
    home = first.headers["x-fleetllm-worker"]
    wait_state(b.url, lambda s: any(w["name"] == home and w["exact_blocks"] > 0 for w in s["workers"]))
    wait_state(a.url, lambda s: _exact(a.url) == _exact(b.url))
    wait_state(b.url, _idle)  # the workers' load reports no longer show the first request
    a.stop()
    procs.remove(a)
    for i in range(1, 4):
        r = httpx.post(b.url + "/v1/chat/completions", json=_chat(i), timeout=30)
        assert r.status_code == 200 and r.headers["x-fleetllm-worker"] == home
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
