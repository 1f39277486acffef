#!/usr/bin/env bash
# Set up, start a fleet serving the embedded SmolLM2-135M on 127.0.0.1:${PORT:-8000} (2 workers behind the
# KV-aware router), stream one real answer through the official openai client, then serve until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! bash scripts/setup.sh > >(grep -v "^WARNING: Location") 2>&1; then
  echo "scripts/setup.sh failed: not starting the fleet" >&2
  exit 1
fi
. .venv/bin/activate
PORT=${PORT:-8000}
REPLICAS=${REPLICAS:-2}
# the admin token (what /router/state asks for) in a private directory of this run, removed with the fleet
TOKEN_DIR=$(mktemp -d)
TOKEN_FILE="$TOKEN_DIR/admin-token"
fleetllm serve --replicas "$REPLICAS" --model smollm2-135m --host 127.0.0.1 --port "$PORT" \
  --admin-token-file "$TOKEN_FILE" ${SPECULATIVE:+--speculative "$SPECULATIVE"} &
FLEET=$!
# (each step may fail where the fleet ended first: under set -e a failing step would end the trap before the rm)
trap 'kill $FLEET 2>/dev/null || true; wait $FLEET 2>/dev/null || true; rm -rf "$TOKEN_DIR"' EXIT INT TERM
for _ in $(seq 600); do
  [ -s "$TOKEN_FILE" ] && curl -sf -H "Authorization: Bearer $(cat "$TOKEN_FILE")" "http://127.0.0.1:$PORT/router/state" | python -c 'import json,sys; s=json.load(sys.stdin); sys.exit(not all(w["healthy"] for w in s["workers"]))' 2>/dev/null && break
  kill -0 $FLEET 2>/dev/null || { echo "fleet failed to start" >&2; exit 1; }
  sleep 0.5
done
python scripts/ask.py --base-url "http://127.0.0.1:$PORT/v1" "Explain in two sentences what a KV cache is."
echo
echo "Serving smollm2-135m at http://127.0.0.1:$PORT/v1 (OpenAI API, $REPLICAS workers, kv_aware routing). Ctrl-C to stop."
wait $FLEET
