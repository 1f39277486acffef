"""Helpers shared by the benchmark scripts: stopping the servers they start, their logs, the machine."""

from __future__ import annotations

import platform
import subprocess
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
