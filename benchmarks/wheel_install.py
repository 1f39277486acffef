"""Decode speed from the wheel on a machine with no compiler, against the editable checkout on the same machine.

Builds the wheel (``pip wheel --no-deps``, pip's default build isolation) from a copy of the sources, installs
it in a fresh venv whose ``PATH`` is its own ``bin`` folder alone (no ``cc``/``gcc``; the project's
dependencies seen through a ``.pth`` line), and runs ``LLM("smollm2-135m")`` greedy decoding at concurrency 1
there and from the checkout (``PYTHONPATH``, kernels built on first use and cached), in alternating
processes. Each process waits for its kernels, warms up, then times ``--rounds`` requests of ``--max-tokens``
tokens (``ignore_eos``; a short chat prompt, its prefill included) and reports each request's tok/s and the
kernel builds it loaded. Prints, per install, the median and the best request (on a shared host other
processes' bursts slow single requests several-fold, so the best is the figure least polluted by them) and
both ratios; the goal is within 10%.

    python benchmarks/wheel_install.py [--max-tokens 64] [--rounds 3] [--processes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import cpu_model

ROOT = Path(__file__).resolve().parents[1]

# Run in each environment: the tok/s of c=1 greedy decoding and the kernels it ran.
MEASURE = """
import json, statistics, sys, time
from fleetllm import LLM, SamplingParams
from fleetllm.kernels.health import statuses
max_tokens, rounds = int(sys.argv[1]), int(sys.argv[2])
llm = LLM("smollm2-135m")
kernels = {s.kernel: s.variant for s in statuses(wait=True)}
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
prompt = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
llm.chat(prompt, SamplingParams(max_tokens=16, temperature=0.0))  # warm-up
rates = []
for _ in range(rounds):
    t = time.perf_counter()
    out = llm.chat(prompt, params)
    rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t))
gomp = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
print(json.dumps({"tok_s": statistics.median(rates), "rates": rates, "kernels": kernels, "libgomp": gomp,
                  "fleetllm": __import__("fleetllm").__file__}))
"""


def build_wheel(work: Path) -> tuple[Path, float]:
    """The wheel built from a copy of the sources, and the seconds ``pip wheel`` took."""
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src)
    shutil.copytree(ROOT / "fleetllm", src / "fleetllm", ignore=shutil.ignore_patterns("__pycache__", "_prebuilt"))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(src)],
                   check=True)
    return next((work / "dist").glob("fleetllm-*.whl")), time.perf_counter() - t


def fresh_venv(work: Path, wheel: Path) -> Path:
    """A venv holding only the wheel; the dependencies through a .pth line to this interpreter's site-packages."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def measure(python: str, env: dict[str, str], cwd: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run([python, "-c", MEASURE, str(args.max_tokens), str(args.rounds)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed requests per process")
    p.add_argument("--processes", type=int, default=4, help="processes per install, alternated")
    args = p.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CC")}
    with tempfile.TemporaryDirectory(prefix="fleetllm-wheel-") as tmp:
        work = Path(tmp)
        wheel, build_s = build_wheel(work)
        venv = fresh_venv(work, wheel)
        wheel_env = {**base, "PATH": str(venv / "bin"), "FLEETLLM_REQUIRE_KERNELS": "1"}
        assert shutil.which("cc", path=wheel_env["PATH"]) is None and shutil.which("gcc", path=wheel_env["PATH"]) is None
        checkout_env = {**base, "PYTHONPATH": str(ROOT)}
        runs: dict[str, list[dict]] = {"wheel": [], "checkout": []}
        for _ in range(args.processes):
            runs["wheel"].append(measure(str(venv / "bin" / "python"), wheel_env, work, args))
            runs["checkout"].append(measure(sys.executable, checkout_env, ROOT, args))
    print(f"{cpu_model()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end; wheel built in "
          f"{build_s:.1f} s ({wheel.name})")
    summary = {}
    for name, results in runs.items():
        rates = [rate for x in results for rate in x["rates"]]
        summary[name] = (statistics.median(rates), max(rates))
        print(f"{name:<9} median {summary[name][0]:6.1f} tok/s, best {summary[name][1]:6.1f}  requests "
              f"{[round(rate, 1) for rate in rates]}  from {results[0]['fleetllm']}")
        print(f"          kernels {results[0]['kernels']}  libgomp {results[0]['libgomp']}")
    for i, what in enumerate(("median", "best")):
        ratio = summary["wheel"][i] / summary["checkout"][i]
        print(f"wheel / checkout ({what}): {ratio:.3f} ({'within' if abs(1 - ratio) <= 0.10 else 'OUTSIDE'} 10%)")


if __name__ == "__main__":
    main()
