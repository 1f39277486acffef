#!/usr/bin/env bash
# Create .venv (if missing) and install fleetllm with its test tools. Idempotent; no model downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --disable-pip-version-check torch==2.13.0   # the local CPU wheel; CUDA builds come from a custom index
pip install -q --disable-pip-version-check -e ".[test]"
