"""Compiles fleetllm's C kernels into the wheel: one shared object per kernel and instruction-set variant.

The kernels are plain C loaded with ctypes (no Python C API), so an object is named by its kernel, variant
and source hash (``fleetllm/kernels/variants.py``) rather than by the interpreter's ABI, and the wheel is
tagged ``py3-none-<platform>``. At import the package loads the best variant the CPU runs
(``fleetllm/kernels/build.py``): the machine it is installed on needs no compiler.

An editable install (``pip install -e .``) compiles nothing: a checkout builds the variant its CPU runs on
first use and caches it, so an edited source is rebuilt on the next start instead of a stale object loading.
Everything else (metadata, packages, package data) is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

KERNEL_DIR = Path("fleetllm", "kernels")


def _variants():
    """fleetllm/kernels/variants.py, loaded by path: neither fleetllm nor torch is importable here."""
    spec = importlib.util.spec_from_file_location("_fleetllm_kernel_variants", KERNEL_DIR / "variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


VARIANTS = _variants()


class KernelExtension(Extension):
    """One kernel's object for one variant; ``name`` is its module-style path inside the package."""

    def __init__(self, source: Path, variant: str) -> None:
        name = VARIANTS.library_name(source.stem, variant, VARIANTS.source_digest(source)).removesuffix(".so")
        super().__init__(".".join([*KERNEL_DIR.parts, VARIANTS.PREBUILT_DIR, name]), [str(source)])
        self.source, self.variant = source, variant


class BuildKernels(build_ext):
    """Runs each kernel's compile command (the one a first use runs), the objects side by side."""

    def get_ext_filename(self, fullname: str) -> str:
        return fullname.rsplit(".", 1)[-1] + ".so"  # a plain shared object, not a CPython extension module

    def run(self) -> None:
        if not self.editable_mode:  # a checkout builds on first use (see the module's docstring)
            super().run()

    def build_extensions(self) -> None:
        largest_first = sorted(self.extensions, key=lambda ext: -ext.source.stat().st_size)  # the longest compiles
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(self.build_extension, largest_first))

    def build_extension(self, ext: KernelExtension) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = VARIANTS.compile_command(os.environ.get("CC", "cc"), ext.source, ext.variant, out)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:  # a wheel without one of its kernels would serve 2-9x slower: no wheel at all
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")


class KernelWheel(bdist_wheel):
    """Tagged for the platform (the objects are machine code) but any Python 3 (no C API inside)."""

    def get_tag(self) -> tuple[str, str, str]:
        return ("py3", "none", super().get_tag()[2])



def _extensions() -> list[KernelExtension]:
    """The objects to compile: ``FLEETLLM_WHEEL_VARIANTS`` (``all`` by default, or ``native``)."""
    try:
        builds = VARIANTS.wheel_builds(os.environ.get(VARIANTS.WHEEL_BUILDS, "all"))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return [KernelExtension(KERNEL_DIR / f"{kernel}.c", variant) for kernel, variant in builds]


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildKernels, "bdist_wheel": KernelWheel},
)
