"""The test files' bytecode, written once for the whole run instead of compiled by every test process.

Where ``PYTHONDONTWRITEBYTECODE`` is set (as on these machines and CI), Python and pytest write no bytecode, but
both still read what exists. Under pytest-xdist each of the four test processes imports every test file at
collection: pytest parses each one, rewrites its asserts and compiles it (~5.5 s of CPU a process, 300 files), and
Python compiles the helper modules. Run as a script by the controlling process before it starts the test
processes (tests/conftest.py), this writes both kinds once (~6 s of CPU over two processes), and every test process
then loads them (~0.5 s). A file edited afterwards no longer matches its bytecode's source hash and is rewritten in
memory as before, so nothing stale runs.

The rewritten form is pytest's own (its rewriter and its pyc layout, from ``_pytest.assertion.rewrite``, as an
import would write them with bytecode writing on); if a pytest release moves those, this writes nothing and the
run is as slow as without it, never wrong.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import py_compile
import sys
from pathlib import Path

try:
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc_fp, get_cache_dir
except ImportError:  # a pytest that moved them: nothing is written, the run is as slow as without this file
    _rewrite_test = None

# pytest's default `python_files` (pyproject.toml sets none) and its conftest files: the modules it rewrites
REWRITTEN = ("test_*.py", "*_test.py", "conftest.py")


def _rewritten(fn: Path) -> bool:
    return any(fnmatch.fnmatch(fn.name, p) for p in REWRITTEN)


def _rewritten_pyc(fn: Path) -> Path:
    """Where pytest reads test file ``fn``'s rewritten bytecode."""
    return get_cache_dir(fn) / (fn.name[:-3] + PYC_TAIL)


def stale(files: list[Path]) -> list[Path]:
    """The files whose bytecode is missing or older than their source (none where pytest moved its rewriter)."""
    if _rewrite_test is None:
        return []
    out = []
    for fn in files:
        if _rewritten(fn):
            fresh = _read_pyc(fn, _rewritten_pyc(fn)) is not None
        else:
            pyc = Path(importlib.util.cache_from_source(str(fn)))
            fresh = pyc.exists() and pyc.stat().st_mtime >= fn.stat().st_mtime
        if not fresh:
            out.append(fn)
    return out


def write(files: list[Path]) -> int:
    """Bytecode for each file (pytest's rewritten form for test files, Python's own for the rest); how many."""
    if _rewrite_test is None:
        return 0
    written = 0
    for fn in files:
        if _rewritten(fn):
            source_hash, co = _rewrite_test(fn, None)  # type: ignore[arg-type]  # None: the default ini
            pyc = _rewritten_pyc(fn)
            pyc.parent.mkdir(exist_ok=True)
            tmp = pyc.with_name(f"{pyc.name}.{os.getpid()}")
            with open(tmp, "wb") as fp:
                _write_pyc_fp(fp, source_hash, co)
            os.replace(tmp, pyc)  # a reader never sees half a file
        else:
            py_compile.compile(str(fn), cfile=importlib.util.cache_from_source(str(fn)), doraise=True)
        written += 1
    return written


if __name__ == "__main__":
    write([Path(a) for a in sys.argv[1:]])
