"""The wheel, as ``pip install fleetllm`` would install it: every file the package reads inside, and the kernels
prebuilt, so a fresh venv with no C compiler on PATH and no source tree on sys.path generates with every kernel
(``FLEETLLM_REQUIRE_KERNELS=1``), serves a simulated worker and runs the recommender.

The wheel is built here (once per module) with pip's default build isolation, from a copy of the sources (a
build writes ``build/`` and ``*.egg-info`` beside them), holding the build of each kernel this CPU loads
(``FLEETLLM_WHEEL_VARIANTS=native``: a third of the compiles; which builds ``all`` holds is pinned in
``tests/kernels/test_variants.py``). The fresh venv sees the project's installed
dependencies through a ``.pth`` line naming this interpreter's site-packages instead of installing them again;
that folder's own ``.pth`` files (the editable install's finder among them) are not read through it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from fleet_helpers import free_port, stop_process

from fleetllm.kernels.variants import PREBUILT_DIR, WHEEL_BUILDS, wheel_builds

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src)
    shutil.copytree(ROOT / "fleetllm", src / "fleetllm", ignore=shutil.ignore_patterns("__pycache__", PREBUILT_DIR))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)], check=True,
                   env={**{k: v for k, v in os.environ.items() if k != "PIP_NO_BUILD_ISOLATION"}, WHEEL_BUILDS: "native"})
    return next(out.glob("fleetllm-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel; its bin folder is the whole PATH its commands get."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True)
    site = Path(subprocess.run([root / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def env_of(venv: Path) -> dict[str, str]:
    """No compiler on PATH, no source tree on sys.path, every kernel required."""
    env = {"PATH": str(venv / "bin"), "HOME": os.environ["HOME"], "FLEETLLM_REQUIRE_KERNELS": "1",
           "PYTHONUNBUFFERED": "1"}
    env.update({k: os.environ[k] for k in ("OMP_NUM_THREADS", "FLEETLLM_CACHE_DIR", "LANG") if k in os.environ})
    assert shutil.which("cc", path=env["PATH"]) is None and shutil.which("gcc", path=env["PATH"]) is None
    return env


def run(venv: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "fleetllm"), *args], capture_output=True, text=True, env=env_of(venv),
                          cwd=venv, timeout=timeout)


def test_wheel_holds_every_file_the_package_reads_and_every_kernel_build(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fleetllm").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc", ".so")}
    assert data and data <= names, sorted(data - names)
    built = {tuple(n.rsplit("/", 1)[1].split("-")[:2]) for n in names if f"/{PREBUILT_DIR}/" in n}
    assert built == set(wheel_builds("native"))


def test_wheel_generates_with_every_kernel_and_no_compiler(venv: Path) -> None:
    done = run(venv, "generate", "--max-tokens", "8", "Name a colour.")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "unavailable" not in done.stderr


def test_wheel_serves_a_simulated_worker(venv: Path) -> None:
    port = free_port()
    popen = subprocess.Popen([str(venv / "bin" / "fleetllm"), "worker", "--simulate", "--host", "127.0.0.1", "--port",
                              str(port)], env=env_of(venv), cwd=venv, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        end, ready = time.monotonic() + 60, None
        while ready is None and popen.poll() is None and time.monotonic() < end:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
                ready = answer.json() if answer.status_code == 200 else None
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert ready == {"status": "ready"}, popen.stderr.read() if popen.poll() is not None else "not ready in 60 s"
    finally:
        stop_process(popen, timeout=20)


def test_wheel_recommends_a_deployment(venv: Path) -> None:
    done = run(venv, "recommend", "--model", "smollm2-135m", "--workload", "isl=96:16,osl=16", "--traffic", "0.4",
               "--instances", "local-cpu", "--simulate-top", "0", "--json", "--out", str(venv / "recommend-out"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ranked"]
