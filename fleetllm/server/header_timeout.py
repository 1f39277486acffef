"""Slow-loris protection: a connection gets a fixed time to deliver each request's headers.

uvicorn times out idle keep-alive connections but not a request's headers: a client that opens a
connection and trickles header bytes (or sends none) holds it, and its slot, forever, and a few hundred
such clients exhaust a server. This subclass of uvicorn's httptools protocol arms a timer when a
connection opens and when a request's first byte arrives, and disarms it when the headers are complete;
if it fires first the client gets ``408`` and the connection is closed. Bodies and responses are not
timed: a long prompt upload or a stream of many minutes is the normal case, not an attack.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_HEADER_TIMEOUT_S = 10.0
log = logging.getLogger(__name__)
_BODY = b"request headers came too slow"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BODY), _BODY))


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a per-request header deadline of ``header_timeout_s``."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing is timed too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # each request on a kept-alive connection gets its own allowance

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closed a connection from %s: no complete request headers in %.1fs", self.client,
                     self.header_timeout_s)
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class (uvicorn's ``http=``) with a header deadline of ``header_timeout_s`` seconds."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
