"""What the router presents upstream: the fleet's secret to its own workers, and to nobody else.

Every request the router's HTTP client sends (forwarded completions, health checks, KV-event streams,
metrics scrapes, remote prefills) passes here. Only a fleetllm worker gets ``Authorization: Bearer
<secret>``: one named ``fleetllm+http://...`` (as ``fleetllm serve``, the fleet controller and discovery name
the fleet's copies), or a plain URL once it has shown itself one (its ``/kv/events`` answered, or refused
with a fleetllm worker's 401: :data:`fleetllm.server.worker_secret.CHALLENGE`). A vLLM, SGLang, TGI,
llama.cpp or OpenAI server never sees the secret, and no upstream sees a client's credential once the
router holds its own (a secret or keys).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import httpx

Origin = tuple[str, str, int | None]
UNKNOWN = "unknown"


def origin(url: httpx.URL | str) -> Origin:
    u = url if isinstance(url, httpx.URL) else httpx.URL(url)
    return u.scheme, u.host, u.port


class WorkerAuth(httpx.Auth):
    """httpx auth of the router's client; ``kind_at(origin)`` is the engine kind of the worker listening
    there (None: a plain URL not yet probed; ``UNKNOWN``: no worker of the router's)."""

    def __init__(self, secret: str, kind_at: Callable[[Origin], str | None]) -> None:
        self.header = f"Bearer {secret}"
        self.kind_at = kind_at

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if self.kind_at(origin(request.url)) == "fleetllm":
            request.headers["authorization"] = self.header
        else:
            request.headers.pop("authorization", None)
        yield request
