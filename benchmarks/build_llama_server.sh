#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the real multi-slot peer: llama-cpp-python's own server answers
# one request at a time) from the llama.cpp source vendored in the llama-cpp-python sdist, in a cache dir
# outside the repo, with `llama-quantize` beside it (the MoE benchmarks' Q4_K_M files are made by llama.cpp itself).
# Idempotent: exits at once when both binaries already exist.
# GGML_NATIVE=ON compiles llama.cpp's AMX kernels where /proc/cpuinfo lists AMX; on VMs that list AMX
# but do not grant it, the server dies at start (SIGILL/SIGSEGV in `tilezero`). engine_vs_peers.py then
# reruns it with `--no-repack`, which switches those kernels off at run time (no rebuild needed).
#
# Usage: benchmarks/build_llama_server.sh            # prints the binary's path on success
# Env:   FLEETLLM_PEERS_DIR (default ~/.cache/fleetllm-peers)
#        LLAMA_CPP_PYTHON_VERSION (default 0.3.36), BUILD_JOBS (default 2)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${FLEETLLM_PEERS_DIR:-$HOME/.cache/fleetllm-peers}"
JOBS="${BUILD_JOBS:-2}"
SRC="$ROOT/llama_cpp_python-$VERSION"  # the sdist's top folder
LLAMA="$SRC/vendor/llama.cpp"
BIN="$LLAMA/build/bin/llama-server"

if [[ -x "$BIN" && -x "$(dirname "$BIN")/llama-quantize" ]]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$ROOT"
if [[ ! -d "$LLAMA" ]]; then
  PIP="${PIP:-python -m pip}"
  # --no-binary for this package only: ":all:" would also build its build deps from source (slow).
  $PIP download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$ROOT/sdist" >&2
  tar -xzf "$ROOT/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT"
fi

cd "$LLAMA"
start=$(date +%s)
cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
nice -n "${BUILD_NICE:-19}" cmake --build build --target llama-server llama-quantize -j"$JOBS" >&2
echo "built llama-server and llama-quantize in $(( $(date +%s) - start )) s" >&2
echo "$BIN"
