"""``--state-url``: where the routers of a fleet keep what they share (a Redis server), and how it is logged.

``redis://[[user]:password@]HOST:PORT[/DB]`` or ``rediss://...`` (TLS). ``auto`` (``fleetllm serve`` only)
starts a private ``redis-server`` with the fleet (:mod:`fleetllm.fleet.redis_server`). A password never
reaches a log line: :func:`redact` replaces it.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit, urlunsplit

from fleetllm.errors import UsageError

AUTO = "auto"
SCHEMES = ("redis", "rediss")


class StateURLError(UsageError, argparse.ArgumentTypeError):
    """A --state-url that is no Redis URL: one line, the password redacted (argparse prints an
    ``ArgumentTypeError``'s message as it is)."""


def fleet_state_url_value(text: str) -> str:
    """``fleetllm serve --state-url``: a redis:// or rediss:// URL, or ``auto`` (a ValueError otherwise)."""
    return AUTO if text.strip().lower() == AUTO else state_url_value(text)


def state_url_value(text: str) -> str:
    """``fleetllm router --state-url``: a redis:// or rediss:// URL with a host (a ValueError otherwise)."""
    text = text.strip()
    try:
        u = urlsplit(text)
        ok = u.scheme in SCHEMES and bool(u.hostname)
        u.port  # noqa: B018  (raises ValueError for a port that is not a number)
    except ValueError:
        ok = False
    if not ok:
        raise StateURLError(f"a state URL is redis://HOST:PORT or rediss://HOST:PORT (fleetllm serve: or auto), "
                         f"not {redact(text)!r}")
    return text


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (the user name, host and port kept)."""
    try:
        u = urlsplit(url)
        password = u.password
    except ValueError:
        return "<unparsable URL>"
    if not password:
        return url
    user = u.username or ""
    host = u.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))
