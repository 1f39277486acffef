#!/usr/bin/env bash
# Install AIPerf 0.13 (NVIDIA's LLM load generator, PyPI `aiperf`) in its own venv outside the repo,
# for benchmarks/bench_vs_aiperf.py. Idempotent: does nothing when the right version is already there.
# The venv is ~1.2 GB, so it lives in the peers cache, never in the project's own .venv.
#   benchmarks/install_aiperf.sh            # -> ~/.cache/fleetllm-peers/aiperf-venv/bin/aiperf
#   AIPERF_VENV=/elsewhere benchmarks/install_aiperf.sh
set -euo pipefail

VERSION="${AIPERF_VERSION:-0.13.0}"
VENV="${AIPERF_VENV:-$HOME/.cache/fleetllm-peers/aiperf-venv}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/aiperf" ] && \
   [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("aiperf"))' 2>/dev/null)" = "$VERSION" ]; then
    echo "aiperf $VERSION already installed: $VENV/bin/aiperf"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "aiperf==$VERSION"
"$VENV/bin/aiperf" --version >/dev/null 2>&1 || "$VENV/bin/aiperf" --help >/dev/null
echo "installed aiperf $VERSION: $VENV/bin/aiperf"
