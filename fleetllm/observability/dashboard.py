"""The live dashboard: one self-contained HTML page (inline JS and canvas charts, no CDN) at ``/dashboard``.

The page polls the same origin's ``/metrics`` every 2 s, parses the Prometheus text in the browser,
and computes rates and histogram quantiles from successive scrapes, as ``rate()`` and
``histogram_quantile()`` would. Whatever serves ``/metrics`` (a worker, or the router with its
workers federated) can mount it with :func:`dashboard_routes`; series it does not find are shown as
"no data" rather than failing.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

PAGE = Path(__file__).with_name("dashboard.html")


@cache
def dashboard_html() -> str:
    return PAGE.read_text(encoding="utf-8")


async def _dashboard(request: Request) -> HTMLResponse:
    return HTMLResponse(dashboard_html(), headers={"cache-control": "no-cache"})


def dashboard_routes(path: str = "/dashboard") -> list[Route]:
    """Routes serving the dashboard at ``path``; it reads ``/metrics`` on the same origin."""
    return [Route(path, _dashboard, methods=["GET"])]
