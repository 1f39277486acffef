"""How a KV frame's bytes reach the decode worker, so that it can import each layer as soon as it is in.

- :class:`Whole`: the frame is all there (a shared-memory file named in a JSON body, read in place).
- :class:`Streamed`: an HTTP body (``application/octet-stream``), written into one buffer of the frame's
  size (known from its head) as it arrives.
- :class:`Notified`: a shared-memory file that the prefill worker is still filling; the body (``SHM_STREAM``)
  is a JSON line naming the file, then one byte each time a layer (then the trailer) is final.

Each gives the frame's buffer (:meth:`head`) and waits until layer ``i`` is in (:meth:`until`); a frame cut
short or overlong is a :class:`FrameError`. Used by :mod:`.routes`; the file checks (which files may be
mapped) are there. Shared-memory files are mapped through :class:`Mappings`, which keeps a file's mapping
for the next frame in it (a prefill worker reuses its frame buffers).
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fleetllm.disagg.frame import FrameError, FrameHeader, head_size

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

    def has(self, i: int, end: int) -> bool:
        """Whether layer ``i`` (ending at ``end``) is in, without waiting."""
        return len(self.buf) >= end

    async def end(self, size: int) -> None:
        if len(self.buf) != size:
            raise FrameError("truncated or overlong frame (no trailer where expected)")


class Streamed:
    """A frame arriving as an HTTP body, copied once into a buffer of its size: its head is read (at most
    ``max_head`` bytes) and ``check`` passes its header (it fits this engine, so its size is bounded by the pool's)
    before that buffer is made."""

    via = "http"

    def __init__(self, chunks: AsyncIterator[bytes], check: Callable[[FrameHeader], None], max_head: int) -> None:
        self.chunks, self.check, self.max_head = chunks, check, max_head
        self.buf = bytearray()
        self.got = 0

    async def head(self) -> bytearray:
        first = bytearray()
        while (n := head_size(first, self.max_head)) is None or len(first) < n:
            first += await self._next(len(first))
        from fleetllm.disagg.frame import FrameReader

        size = FrameReader(first, self.check).size  # the head says how long the frame is: one buffer, written in place
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

    def has(self, i: int, end: int) -> bool:
        return self.got >= end

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

    def __init__(self, chunks: AsyncIterator[bytes], check: Any, mappings: Mappings) -> None:
        """``check(path)``: raise unless the file may be mapped."""
        self.chunks, self.check, self.mappings = chunks, check, mappings
        self.seen = 0  # layers final so far (the trailer counts as one more)
        self.buf: memoryview | None = None

    async def head(self) -> memoryview:
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
        self.buf = await asyncio.to_thread(self.mappings.map, path, spec.get("bytes"))
        self.seen = len(rest)
        return self.buf

    async def until(self, i: int, end: int) -> None:
        while self.seen <= i:
            self.seen += len(await self._next())

    def has(self, i: int, end: int) -> bool:
        return self.seen > i

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


class Mappings:
    """Read-only mappings of shared-memory frame files, each kept while its file exists (the last ``keep``).

    A prefill worker writes its next frames into the same few files, so the next frame in a file is read
    through the mapping already made: mapping and populating a 94 MB frame costs about as much as copying
    it, and unmapping a third of that again. A mapping dropped here is unmapped once nothing reads it.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._maps: OrderedDict[Path, tuple[tuple[int, int, int], mmap.mmap]] = OrderedDict()
        self._lock = threading.Lock()

    def map(self, path: Path, nbytes: Any, reuse: bool = True) -> memoryview:
        """The first ``nbytes`` of ``path`` (default: all of it); ``reuse`` False: the file is about to go."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size)
        n = int(nbytes) if nbytes is not None else st.st_size
        if n > st.st_size or n < 0:
            raise ValueError(f"{n} bytes asked of a file of {st.st_size}")
        with self._lock:
            held = self._maps.get(path)
            if held is not None and held[0] == key:
                self._maps.move_to_end(path)
                return memoryview(held[1])[:n]
        m = map_file(path, st.st_size)
        if reuse:
            with self._lock:
                self._maps[path] = (key, m)
                for gone in [p for p in self._maps if not p.exists()]:  # its sender removed it: no next frame
                    del self._maps[gone]
                while len(self._maps) > self.keep:
                    self._maps.popitem(last=False)
        return memoryview(m)[:n]
