"""The C kernels, the instruction-set builds each one has, and which build this CPU runs.

Each kernel picks its SIMD paths at run time inside the object (``__builtin_cpu_supports`` and functions
marked ``target("avx2,fma")`` and the like), so every build runs on every x86-64 CPU that has its baseline. A
variant is how the *rest* of the object is compiled: ``avx512`` and ``avx2`` let the compiler use those
instructions everywhere (the scalar loops, the inlined helpers), ``portable`` assumes nothing and is the only
build on other architectures. ``-std=c11`` keeps ``-ffp-contract=off`` whatever the variant, so every variant
computes the same bits.

A wheel carries one object per kernel and variant (``setup.py`` compiles them, named by :func:`library_name`);
at run time :func:`supported_variants` orders the ones this CPU can run, best first, from
``/proc/cpuinfo``'s flags, as llama.cpp's ``GGML_CPU_ALL_VARIANTS`` does.

This module imports nothing from fleetllm or torch: ``setup.py`` loads it by path inside pip's build
environment, where neither is installed.
"""

from __future__ import annotations

import hashlib
import platform
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
PREBUILT_DIR = "_prebuilt"  # beside the sources, in the package: the wheel's objects
X86 = ("x86_64", "amd64", "i686", "i386")


@dataclass(frozen=True)
class Variant:
    """One instruction-set level: the compiler's flags for it and the ``/proc/cpuinfo`` flags it needs."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]
    x86_only: bool = True


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")

VARIANTS = {v.name: v for v in (
    Variant("avx512", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                       "-mavx512bf16"), frozenset(_AVX512)),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset(_AVX2)),
    Variant("portable", (), frozenset(), x86_only=False),
)}


@dataclass(frozen=True)
class Kernel:
    """One C source: its variants (best first), the CPU flags its fast path needs (none: it has a scalar path
    too), and what serving without it costs, for the error a person reads."""

    name: str
    variants: tuple[str, ...]
    needs: frozenset[str]
    cost: str


KERNELS = {k.name: k for k in (
    Kernel("q4_int_gemm", ("avx512", "avx2", "portable"), frozenset(_AVX2),
           "the q4 default's linears run dequantised fp32 and the decode stack is off: decode ~9x slower"),
    Kernel("decode_stack", ("avx2", "portable"), frozenset(_AVX2),
           "decode steps run layer by layer in PyTorch: decode ~2x slower at one request"),
    Kernel("paged_attention", ("avx2", "portable"), frozenset(),
           "attention gathers the KV cache in PyTorch and the decode stack is off: decode ~2x slower or more"),
    Kernel("q4_gemv", ("avx2", "portable"), frozenset(),
           "int4 linears dequantise in PyTorch: int4 decode several times slower"),
    Kernel("q8_gemv", ("avx2", "portable"), frozenset(),
           "the Q8_0 LM head runs in fp32 PyTorch: each step's last layer slower"),
    Kernel("moe_experts", ("avx512", "avx2", "portable"), frozenset(),
           "a mixture-of-experts model's decode steps run their router and experts op by op in PyTorch: MoE "
           "decode ~2x slower"),
    Kernel("bf16_gemm", ("avx512", "portable"), frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
           "wide steps (prefill, large batches) take the Q4 or fp32 GEMM: prefill slower"),
    Kernel("prefill_attention", ("avx512", "portable"), frozenset({"avx512f", "avx512bw"}),
           "prefill attention runs in PyTorch: long prompts slower"),
    Kernel("lora", ("avx512", "avx2", "portable"), frozenset(),
           "steps with LoRA adapter rows leave the decode stack (decode ~2x slower at one request) and their "
           "updates run as PyTorch GEMMs per adapter"),
)}


@cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and instruction-set flags, as ``/proc/cpuinfo`` reports them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine(), frozenset()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("model name", platform.machine()), frozenset(fields.get("flags", fields.get("Features", "")).split())


def variants_for_machine(machine: str | None = None) -> tuple[str, ...]:
    """The variants built on an architecture (``platform.machine()`` by default): all on x86, else portable."""
    x86 = (machine or platform.machine()).lower() in X86
    return tuple(name for name, v in VARIANTS.items() if x86 or not v.x86_only)


WHEEL_BUILDS = "FLEETLLM_WHEEL_VARIANTS"  # which objects ``setup.py`` compiles into a wheel: see wheel_builds


def wheel_builds(selection: str = "all") -> list[tuple[str, str]]:
    """The ``(kernel, variant)`` objects a wheel built here carries. ``all`` (the default): every variant built on
    this architecture, a wheel for any CPU of it; ``native``: the one build each kernel loads on this CPU, a wheel
    for this machine only (a third of the compiles on x86), as ``TORCH_CUDA_ARCH_LIST`` narrows a CUDA build."""
    if selection == "all":
        here = variants_for_machine()
        return [(k, v) for k in KERNELS for v in KERNELS[k].variants if v in here]
    if selection == "native":
        return [(k, supported_variants(k)[0]) for k in KERNELS]
    raise ValueError(f"{WHEEL_BUILDS}={selection!r}: expected 'all' or 'native'")


def supported_variants(kernel: str, flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The variants of ``kernel`` this CPU runs (``flags``: its ``/proc/cpuinfo`` flags), best first."""
    flags = cpu_info()[1] if flags is None else flags
    here = variants_for_machine()
    return tuple(v for v in KERNELS[kernel].variants if v in here and VARIANTS[v].cpu_flags <= flags)


def expected_variant(kernel: str, flags: frozenset[str] | None = None) -> str | None:
    """The build this CPU should run ``kernel`` from; None when the CPU lacks what its fast path needs (then the
    callers' PyTorch path is the right one, not a fallback)."""
    flags = cpu_info()[1] if flags is None else flags
    if not KERNELS[kernel].needs <= flags:
        return None
    supported = supported_variants(kernel, flags)
    return supported[0] if supported else None


def source_digest(source: Path) -> str:
    """Hash of a kernel's source and the headers it includes from its own folder (``simd.h`` through
    ``gemv_common.h`` too): names its prebuilt objects, so an edited source never loads an object built from
    the old one."""
    texts, pending, seen = [], [source.name], set()
    while pending:  # the source, then every header it includes (and they include) from its folder
        name = pending.pop(0)
        if name not in seen:
            seen.add(name)
            texts.append((source.parent / name).read_text())
            pending += re.findall(r'^#include "([^"]+)"', texts[-1], re.M)
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def library_name(kernel: str, variant: str, digest: str) -> str:
    """The file name of ``kernel``'s ``variant`` object built from a source with ``digest``."""
    return f"{kernel}-{variant}-{digest}.so"


def compile_command(cc: str, source: Path, variant: str, out: Path) -> list[str]:
    """The command that builds ``source``'s ``variant`` into ``out``: the same for the wheel and a first use."""
    return [cc, *BASE_FLAGS, *VARIANTS[variant].cflags, str(source), "-o", str(out), "-lm"]
