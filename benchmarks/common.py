"""Helpers shared by the benchmark scripts: stopping the servers they start, their logs, the machine."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import socket
import subprocess
import time
from pathlib import Path


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 20 s; only this process."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: str | Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file."""
    return "".join(Path(path).read_text(errors="replace").splitlines(keepends=True)[-lines:])


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (what `nproc` does not say)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


RESULTS = Path(__file__).resolve().parents[1] / "results"  # git-ignored: the last run of each benchmark


def save_run(heading: str, intro: str, cmd: str, lines: str) -> Path:
    """Write this run (its machine, ``cmd`` and result ``lines``) to ``results/<heading's slug>.md``, replacing the
    last one, and say so. BENCHMARKS.md is the current results page, edited by hand: its section for this
    capability takes the new figures in place of the old ones (a run never appends a log to it)."""
    slug = re.sub(r"[^a-z0-9]+", "-", heading.lstrip("# ").lower()).strip("-")[:60]
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{slug}.md"
    stamp = (f"### {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}, {os.cpu_count()} cores, "
             f"load average {os.getloadavg()[0]:.2f}\n\n`{cmd}`\n\n")
    path.write_text(f"{heading}\n\n{intro}\n\n{stamp}{lines}")
    print(f"this run: {path} (replace the figures of BENCHMARKS.md's section for it)")
    return path


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> None:
    """Return once a GET of ``url`` (a probe: ``.../health``) answers 200; raise with the log's tail if ``proc`` exits or ``timeout`` passes
    (stopping ``proc`` then)."""
    import httpx  # only the scripts that start servers need it

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited:\n{tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_process(proc)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s:\n{tail(log)}")


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports nothing listens on now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def admin_token(directory: Path) -> tuple[list[str], dict[str, str]]:
    """An admin token minted into ``directory`` for a router or fleet the benchmark starts: the flags that give
    it to ``fleetllm router``/``serve``, and the header that reads ``/router/state`` with it."""
    from fleetllm.router.admin_token import FILE_NAME, admin_headers, mint_token

    path = Path(directory) / FILE_NAME
    if not path.exists():
        mint_token(path)
    return ["--admin-token-file", str(path)], admin_headers(path)
