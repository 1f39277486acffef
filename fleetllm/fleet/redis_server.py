"""A private Redis server (Debian's ``redis-server``) for one fleet: ``fleetllm serve --state-url auto`` and
``--kv-remote auto`` (one server for both).

It listens on a free 127.0.0.1 port, keeps nothing on disk (``--save "" --appendonly no``: the routers'
limits are minutes of counters, worth nothing after a restart) and lives as long as the fleet that started it.
The tests' session-wide store is one of these too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from fleetllm.fleet.lifetime import die_with_parent


class RedisUnavailable(RuntimeError):
    """``redis-server`` is not installed, or did not start."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` child process on 127.0.0.1; :meth:`start` returns once it accepts connections."""

    def __init__(self, port: int | None = None, binary: str = "redis-server", max_memory: int | None = None) -> None:
        """``max_memory``: bytes it may hold, the least recently used keys evicted past them (None: no cap)."""
        self.port = port or _free_port()
        self.binary = binary
        self.max_memory = max_memory
        self.popen: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        exe = shutil.which(self.binary)
        if exe is None:
            raise RedisUnavailable(f"{self.binary} is not installed (Debian: apt-get install redis-server)")
        self._dir = tempfile.TemporaryDirectory(prefix="fleetllm-redis-")  # its working dir: nothing is written there
        log = Path(self._dir.name) / "redis.log"
        self.popen = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--logfile", str(log), "--protected-mode", "yes", *self._cap()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the fleet must not stop the store before the routers
            preexec_fn=die_with_parent)  # but a fleet (or test session) killed outright takes it along
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                tail = log.read_text(errors="replace")[-300:] if log.exists() else ""
                self.stop()
                raise RedisUnavailable(f"redis-server exited with {self.popen.returncode}: {tail.strip()}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer on port {self.port} within {timeout_s:g}s")

    def _cap(self) -> list[str]:
        if self.max_memory is None:
            return []
        return ["--maxmemory", str(self.max_memory), "--maxmemory-policy", "allkeys-lru"]

    def ping(self) -> bool:
        """Whether it answers PING now (a raw RESP exchange: no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash would (the tests' "Redis died" case); :meth:`start` brings it back, empty."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
