"""/dashboard in headless Chromium: after a short load each view (Performance, Capacity, Reliability)
renders its charts with data from /metrics, a screenshot of each is saved, and the page logs no
console errors."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from obs_tools import artifacts_dir, chromium, run_bench

# charts/tables each view must fill from a single worker's metrics (router-only cards may stay empty)
MUST_HAVE_DATA = {
    "performance": ["ttft", "itl", "e2e", "throughput", "requests", "phases"],
    "capacity": ["kv", "running", "waiting", "load", "zones", "replica_tps", "prefix", "cpu"],
    "reliability": ["health", "coldstart"],
}


# the page's own Prometheus text parser on escapes, +Inf, NaN and a sample without labels
PARSE_CHECK = r"""
const text = String.raw`x{a="a \"quoted\"\\path\nline",le="+Inf"} +Inf` + "\ny{a=\"b\"} NaN\nz 3\n# HELP z z\n";
const m = window.fleetDashboard.parseMetrics(text);
const x = m.get("x")[0];
return {label: x.labels.a, inf: String(x.value), nan: Number.isNaN(m.get("y")[0].value), bare: m.get("z")[0].value};
"""


@pytest.fixture(scope="module")
def target(worker_factory: Any) -> str:
    return worker_factory("--zone", "zone-browser", "--worker-id", "browser-w0").base_url


def points(driver: Any, card: str) -> int:
    return int(driver.find_element("id", "card-" + card).get_attribute("data-points"))


def test_dashboard_renders_three_views_with_data_and_no_console_errors(target: str, tmp_path: Any) -> None:
    r = httpx.get(target + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http://" not in r.text and "https://" not in r.text  # self-contained: nothing loaded from elsewhere
    shots = artifacts_dir("dashboard")
    with chromium() as driver:
        driver.get(target + "/dashboard?interval=500&window=20#performance")
        load = threading.Thread(target=run_bench, args=(target, tmp_path / "load.json", "--concurrency", "4",
                                                        "--requests", "12", "--isl", "48", "--osl", "12"))
        load.start()
        load.join()
        time.sleep(1.5)  # a few more scrapes after the load
        assert driver.execute_script("return window.fleetDashboard.scrapes") > 5
        for view, cards in MUST_HAVE_DATA.items():
            driver.find_element("css selector", f'#tabs a[data-view="{view}"]').click()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(points(driver, c) > 0 for c in cards):
                time.sleep(0.25)
            assert driver.find_element("id", "view").get_attribute("data-view") == view
            empty = [c for c in cards if points(driver, c) == 0]
            assert not empty, f"{view}: no data in {empty}"
            driver.save_screenshot(str(shots / f"{view}.png"))
            assert (shots / f"{view}.png").stat().st_size > 10_000
        assert driver.execute_script("return window.fleetDashboard.lastError") is None
        parsed = driver.execute_script(PARSE_CHECK)
        assert parsed == {"label": 'a "quoted"\\path\nline', "inf": "Infinity", "nan": True, "bare": 3}
        logs = driver.get_log("browser")
    errors = [e for e in logs if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
