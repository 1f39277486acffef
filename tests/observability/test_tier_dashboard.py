"""The dashboard's KV tier panels over a real worker with a host-memory tier behind a pool too small for its
prompts: the page in headless Chromium, reading the worker's /metrics while evicted prefixes come back."""

from __future__ import annotations

import time

import pytest
from obs_tools import chromium, points

from tests.kvtier.tier_helpers import complete

pytestmark = pytest.mark.slow  # a browser

CARDS = ("tier_blocks", "tier_bytes", "tier_used", "tier_load", "tier_errors")


def test_the_capacity_view_shows_each_tiers_loads_bytes_holdings_load_time_and_errors(worker_factory) -> None:
    w = worker_factory("--num-blocks", "24", "--max-num-batched-tokens", "128", "--kv-offload-gb", "0.05")
    first = [(7919 + 31 * i) % 3000 + 100 for i in range(100)]
    with chromium() as driver:
        driver.get(w.url + "/dashboard?interval=300&window=30#capacity")
        while driver.execute_script("return window.fleetDashboard.scrapes") < 2:
            time.sleep(0.1)
        complete(w.url, first)
        for k in range(4):  # 7 blocks each: the first prompt's blocks are evicted into host memory
            complete(w.url, [(k * 104729 + 17 * i) % 3000 + 100 for i in range(100)])
        complete(w.url, first)  # loaded back
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(points(driver, c) > 0 for c in CARDS):
            time.sleep(0.25)
        assert [c for c in CARDS if points(driver, c) == 0] == []
        shown = driver.execute_script("return document.getElementById('card-tier_blocks').innerText")
        assert "host loaded" in shown and "host missed" in shown
        assert driver.execute_script("return window.fleetDashboard.lastError") is None
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
