"""Builds fleetllm's C kernels on first use and caches the shared objects on disk.

A kernel is plain C (no torch headers): ``gcc -O3 -fopenmp -shared`` takes about a second, where a
``torch.utils.cpp_extension`` build takes most of a minute. The build runs in a background thread while
the eager PyTorch path serves; callers ask :meth:`KernelLibrary.get` and get ``None`` until it is loaded.

The cache key holds the source's hash, the compiler's version and the CPU's instruction-set flags: an object
built for one CPU can die with an illegal instruction on another one sharing the cache directory (a node
pool's volume). The object is written under a temporary name and renamed into place, so processes building
the same key at once each see either nothing or a whole file. No compiler, or a failed build: a single
warning, and the eager path for good.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from fleetllm.models.source import cache_dir

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def cpu_flags() -> str:
    """The CPU's model name and instruction-set flags, as the kernel of this host reports them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '')}|{fields.get('flags', fields.get('Features', ''))}"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``/``gcc`` on the path; None when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def cache_key(source: Path, cc: str) -> str:
    """Hash of the source, the headers it includes from its own folder, the compiler, the CPU and the flags."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    text = source.read_text()
    headers = [(source.parent / name).read_text() for name in re.findall(r'^#include "([^"]+)"', text, re.M)]
    text = "\n".join([text, *headers, version, cpu_flags(), " ".join(FLAGS)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def build(source: Path, out_dir: Path | None = None) -> Path:
    """The shared object for ``source``: from the cache, or compiled now (raises when it cannot be)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on the path")
    target = _target(f"{source.stem}-{cache_key(source, cc)}.so", out_dir)
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder of the same key replaces an identical file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _target(name: str, out_dir: Path | None) -> Path:
    """Where ``name`` is cached: the first directory holding it, else the first writable one.

    A read-only cache volume falls back to the temporary directory rather than to the eager path.
    """
    dirs = [out_dir] if out_dir else [cache_dir() / "kernels", Path(tempfile.gettempdir()) / "fleetllm-kernels"]
    for d in dirs:
        if (d / name).exists():
            return d / name
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d / name
    raise RuntimeError(f"no writable directory to build {name} in")


class KernelLibrary:
    """One C source, built in the background on first :meth:`get` and loaded with ctypes.

    ``setup`` declares the library's functions (argtypes, restype) once it is loaded.
    """

    def __init__(self, source: Path, setup: Callable[[ctypes.CDLL], None]) -> None:
        self.source = source
        self.setup = setup
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._started = False
        self._lock = threading.Lock()
        self._done = threading.Event()

    def get(self, wait: bool = False) -> ctypes.CDLL | None:
        """The loaded library, or None while it builds (``wait``: until it is built) or when it cannot be."""
        if self.lib is None and not self._done.is_set():
            with self._lock:
                if not self._started:
                    self._started = True
                    threading.Thread(target=self._load, name=f"build-{self.source.stem}", daemon=True).start()
            if wait:
                self._done.wait()
        return self.lib

    def _load(self) -> None:
        try:
            lib = ctypes.CDLL(str(build(self.source)))
            self.setup(lib)
            self.lib = lib
        except Exception as e:  # noqa: BLE001 - any failure means the eager path, said once
            self.error = str(e)
            log.warning("C kernel %s unavailable, using the eager PyTorch path: %s", self.source.name, e)
        finally:
            self._done.set()
