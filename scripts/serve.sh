#!/usr/bin/env bash
# Set up, start a worker serving the embedded SmolLM2-135M on 127.0.0.1:${PORT:-8000},
# stream one real answer through the official openai client, then keep serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh 2>&1 | grep -v "^WARNING: Location" || true
. .venv/bin/activate
PORT=${PORT:-8000}
fleetllm worker --model smollm2-135m --host 127.0.0.1 --port "$PORT" --log-level warning &
WORKER=$!
trap 'kill $WORKER 2>/dev/null; wait $WORKER 2>/dev/null' EXIT INT TERM
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $WORKER 2>/dev/null || { echo "worker failed to start" >&2; exit 1; }
  sleep 0.5
done
python scripts/ask.py --base-url "http://127.0.0.1:$PORT/v1" "Explain in two sentences what a KV cache is."
echo
echo "Serving smollm2-135m at http://127.0.0.1:$PORT/v1 (OpenAI API). Ctrl-C to stop."
wait $WORKER
