"""Loads fleetllm's C kernels: the wheel's prebuilt object for this CPU, else a build on first use, cached on disk.

A wheel carries every kernel compiled per instruction-set variant (``setup.py``; :mod:`.variants`): loading
one is a ``dlopen``, and the target machine needs no compiler. A source checkout has no prebuilt objects (or
ones built from an older source: their names hold the source's hash), so the first use compiles the variant
this CPU runs with ``gcc -O3 -fopenmp -shared`` (about a second: no torch headers) in a background thread
while the eager PyTorch path serves; callers ask :meth:`KernelLibrary.get` and get ``None`` until it is loaded.

The cache key of a first-use build holds the source's hash, the compiler's version, the CPU's instruction-set
flags and the variant's flags: an object built for one CPU can die with an illegal instruction on another one
sharing the cache directory (a node pool's volume). The object is written under a temporary name and renamed
into place, so a process loading it sees either nothing or a whole file; processes that need the same key at once
(a fleet's workers starting on one node) take a lock beside it, so one compiles and the others wait and load
its object instead of each compiling the same source. No prebuilt
object and no compiler, or a failed build: the eager path for good, and the engine's check (:mod:`.health`)
says so at ERROR with what it costs.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from fleetllm.kernels.variants import (
    PREBUILT_DIR,
    compile_command,
    cpu_info,
    library_name,
    source_digest,
    supported_variants,
)
from fleetllm.models.source import cache_dir

log = logging.getLogger(__name__)


def cpu_flags() -> str:
    """The CPU's model name and instruction-set flags, as the kernel of this host reports them."""
    model, flags = cpu_info()
    return f"{model}|{' '.join(sorted(flags))}"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``/``gcc`` on the path; None when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def cache_key(source: Path, cc: str, variant: str) -> str:
    """Hash of the source and its headers, the compiler, the CPU and the variant's command line."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    command = " ".join(compile_command(cc, Path(source.name), variant, Path("out")))
    text = "\n".join([source_digest(source), version, cpu_flags(), command])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def prebuilt(source: Path, variant: str) -> Path | None:
    """The package's object for ``source``'s ``variant``, when it holds one built from this very source."""
    path = source.parent / PREBUILT_DIR / library_name(source.stem, variant, source_digest(source))
    return path if path.exists() else None


def build(source: Path, out_dir: Path | None = None, variant: str | None = None) -> Path:
    """The shared object for ``source``'s ``variant`` (default: the best this CPU runs), from the cache or
    compiled now (raises when it cannot be)."""
    variant = variant or supported_variants(source.stem)[0]
    cc = compiler()
    if cc is None:
        raise RuntimeError("no prebuilt object for this CPU in the package, as in a source install, and no C "
                           "compiler (cc, gcc or $CC) on PATH to build one")
    target = _target(f"{source.stem}-{variant}-{cache_key(source, cc, variant)}.so", out_dir)
    if target.exists():
        return target
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if not target.exists():  # built by whoever held the lock before us
            _compile(cc, source, variant, target)
    return target


def _compile(cc: str, source: Path, variant: str, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(compile_command(cc, source, variant, Path(tmp)), capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder of the same key replaces an identical file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def locate(source: Path) -> tuple[Path, str]:
    """The object to load for ``source`` and its variant: the best prebuilt one this CPU runs, else the best
    variant built (or found in the cache) now."""
    variants = supported_variants(source.stem)
    if not variants:
        raise RuntimeError(f"no build of {source.stem} runs on this CPU")
    for variant in variants:
        if (path := prebuilt(source, variant)) is not None:
            return path, variant
    return build(source, variant=variants[0]), variants[0]


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
    """One C source, loaded (or built) in the background on first :meth:`get` with ctypes.

    ``setup`` declares the library's functions (argtypes, restype) once it is loaded; ``variant`` is the build
    loaded, ``error`` why none could be.
    """

    def __init__(self, source: Path, setup: Callable[[ctypes.CDLL], None]) -> None:
        self.source = source
        self.setup = setup
        self.lib: ctypes.CDLL | None = None
        self.variant: str | None = None
        self.error: str | None = None
        self._started = False
        self._lock = threading.Lock()
        self._done = threading.Event()

    @property
    def name(self) -> str:
        """The kernel's name (its source's stem, a key of :data:`fleetllm.kernels.variants.KERNELS`)."""
        return self.source.stem

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
            path, variant = locate(self.source)
            lib = ctypes.CDLL(str(path))
            self.setup(lib)
            self.lib, self.variant = lib, variant
        except Exception as e:  # noqa: BLE001 - any failure means the eager path, said once
            self.error = str(e)
            # INFO: an engine's check (health.py) says it at ERROR, with what it costs, for a kernel this CPU runs
            log.info("C kernel %s unavailable, using the eager PyTorch path: %s", self.source.name, e)
        finally:
            self._done.set()
