"""The dashboard's disaggregation panels over a real P/D fleet: a prefill and a decode worker (in-process, the
session's weights) behind a router that disaggregates every prompt of 32 tokens or more, the page in headless
Chromium reading the router's federated /metrics while requests go through."""

from __future__ import annotations

import time

import httpx
import pytest
from fleet_helpers import router, wait_state
from obs_tools import chromium, points

pytestmark = pytest.mark.slow  # a browser

PANELS = {"performance": "pd_latency", "capacity": "pd_decisions", "reliability": "pd_waits"}


def test_the_dashboard_shows_prefill_placement_remote_prefills_and_handoff_waits(worker_factory):
    p, d = worker_factory("--role", "prefill"), worker_factory("--role", "decode")
    r = router([p.url, d.url], "kv_aware", "--pd-threshold", "32")
    try:
        wait_state(r.url, lambda s: all(w["healthy"] and w["events_connected"] for w in s["workers"]), 60)
        with chromium() as driver:
            driver.get(r.url + "/dashboard?interval=300&window=30#performance")
            while driver.execute_script("return window.fleetDashboard.scrapes") < 2:
                time.sleep(0.1)
            for i in range(3):  # fresh prompts of ~60 tokens: each prefilled remotely, handed over
                q = f"Request {i}: list the trade-offs of prefilling a long prompt on another machine, in detail."
                body = {"model": "smollm2-135m", "max_tokens": 4, "messages": [{"role": "user", "content": q * 2}]}
                assert httpx.post(r.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
            for view, card in PANELS.items():
                driver.find_element("css selector", f'#tabs a[data-view="{view}"]').click()
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and points(driver, card) == 0:
                    time.sleep(0.25)
                assert points(driver, card) > 0, f"{view}: no data in {card}"
            shown = driver.execute_script("return document.getElementById('card-pd_waits').innerText")
            assert "handed_over" in shown  # the requests waited on the decode worker and took the handoff
            assert driver.execute_script("return window.fleetDashboard.lastError") is None
            errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
    finally:
        r.stop()
