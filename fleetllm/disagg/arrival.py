"""How a KV frame's bytes reach the decode worker, so that it can import each layer as soon as it is in.

- :class:`Whole`: the frame is all there (a shared-memory file named in a JSON body, read in place).
- :class:`Streamed`: an HTTP body (``application/octet-stream``), written into one buffer of the frame's
  size (known from its head) as it arrives.
- :class:`Notified`: a shared-memory file that the prefill worker is still filling; the body (``SHM_STREAM``)
  is a JSON line naming the file, then one byte each time a layer (then the trailer) is final.

Each gives the frame's buffer (:meth:`head`) and waits until layer ``i`` is in (:meth:`until`); a frame cut
short or overlong is a :class:`FrameError`. Used by :mod:`.routes`; the file checks (which files may be
mapped) are there.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fleetllm.disagg.frame import FrameError, head_size

SHM_STREAM = "application/x-fleetllm-kv-shm"


class Whole:
    """A frame whose bytes are all there."""

    def __init__(self, buf: Any, via: str) -> None:
        self.buf, self.via = buf, via

    async def head(self) -> Any:
        return self.buf

    async def until(self, i: int, end: int) -> None:
        if len(self.buf) < end:
            raise FrameError(f"truncated frame: layer {i} incomplete")

    async def end(self, size: int) -> None:
        if len(self.buf) != size:
            raise FrameError("truncated or overlong frame (no trailer where expected)")


class Streamed:
    """A frame arriving as an HTTP body, copied once into a buffer of its size."""

    via = "http"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.buf = bytearray()
        self.got = 0

    async def head(self) -> bytearray:
        first = bytearray()
        while (n := head_size(first)) is None or len(first) < n:
            first += await self._next(len(first))
        from fleetllm.disagg.frame import FrameReader

        size = FrameReader(first).size  # the head says how long the frame is: one buffer, written in place
        if len(first) > size:
            raise FrameError("overlong frame")
        self.buf = bytearray(size)
        self.buf[: len(first)] = first
        self.got = len(first)
        return self.buf

    async def until(self, i: int, end: int) -> None:
        while self.got < end:
            chunk = await self._next(self.got)
            if self.got + len(chunk) > len(self.buf):
                raise FrameError("overlong frame")
            self.buf[self.got : self.got + len(chunk)] = chunk
            self.got += len(chunk)

    async def end(self, size: int) -> None:
        await self.until(-1, size)
        async for chunk in self.chunks:
            if chunk:
                raise FrameError("overlong frame")

    async def _next(self, at: int) -> bytes:
        try:
            return await anext(self.chunks)
        except StopAsyncIteration:
            raise FrameError(f"truncated frame: {at} bytes") from None


class Notified:
    """A shared-memory frame still being filled: one byte of the body per layer made final."""

    via = "shm"

    def __init__(self, chunks: AsyncIterator[bytes], check: Any) -> None:
        """``check(path)``: raise unless the file may be mapped."""
        self.chunks, self.check = chunks, check
        self.seen = 0  # layers final so far (the trailer counts as one more)
        self.buf: mmap.mmap | None = None

    async def head(self) -> mmap.mmap:
        line = b""
        while b"\n" not in line:
            line += await self._next()
        spec_line, rest = line.split(b"\n", 1)
        try:
            spec = json.loads(spec_line)
        except ValueError:
            raise FrameError("bad shared-memory spec line") from None
        path = Path(str(spec.get("shm", "")))
        self.check(path)
        self.buf = await asyncio.to_thread(map_file, path, spec.get("bytes"))
        self.seen = len(rest)
        return self.buf

    async def until(self, i: int, end: int) -> None:
        while self.seen <= i:
            self.seen += len(await self._next())

    async def end(self, size: int) -> None:
        return None  # the trailer's notification came with the last until()

    async def _next(self) -> bytes:
        try:
            return await anext(self.chunks)
        except StopAsyncIteration:
            raise FrameError("the sender stopped before the frame was complete") from None


def map_file(path: Path, nbytes: Any) -> mmap.mmap:
    """The first ``nbytes`` of ``path`` (default: all of it), mapped read-only with every page mapped at once."""
    fd = os.open(path, os.O_RDONLY)
    try:
        n = int(nbytes) if nbytes is not None else os.fstat(fd).st_size
        return mmap.mmap(fd, n, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
    finally:
        os.close(fd)
