#!/usr/bin/env bash
# Set everything up and run Kiln's main job end to end on the embedded default:
# the tiny local model, the embedded Temporal + SeaweedFS, the example counter environment,
# and one durable training run. Leaves `kiln serve` running (Web UI, API) unless KILN_DEMO_KEEP=0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KILN_HOME="${KILN_HOME:-$PWD/.kiln}"
ENV_PORT="${KILN_DEMO_ENV_PORT:-8990}"
mkdir -p "$KILN_HOME/logs"

if [ ! -f "$KILN_HOME/run/serve.json" ]; then
  kiln serve > "$KILN_HOME/logs/serve.out" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 1 240); do
    [ -f "$KILN_HOME/run/serve.json" ] && break
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then cat "$KILN_HOME/logs/serve.out"; exit 1; fi
    sleep 0.5
  done
  [ -f "$KILN_HOME/run/serve.json" ] || { echo "kiln serve did not become ready"; cat "$KILN_HOME/logs/serve.out"; exit 1; }
  cat "$KILN_HOME/logs/serve.out"
else
  SERVE_PID=$(python -c "import json;print(json.load(open('$KILN_HOME/run/serve.json'))['pid'])")
  echo "reusing the running kiln serve (pid $SERVE_PID)"
fi

kiln example-env counter --port "$ENV_PORT" > "$KILN_HOME/logs/counter-env.log" 2>&1 &
ENV_PID=$!
trap 'kill "$ENV_PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -fs "http://127.0.0.1:$ENV_PORT/health" >/dev/null 2>&1 && break
  sleep 0.25
done

kiln openenv inspect --environment "http://127.0.0.1:$ENV_PORT"
set +e
# The demo trains at the training defaults (AdamW 3e-4, CISPO, no KL, ECHO λ 0.05) for 4 online
# collect→train iterations. bench/README.md "The demo's settings" has the measurements behind that choice.
kiln openenv train \
  --environment "http://127.0.0.1:$ENV_PORT" \
  --groups 8 --group-size 4 --max-steps 6 --max-action-tokens 48 \
  --iterations 4 \
  --eval-groups 20 --eval-group-size 2 --gate \
  --output-adapter counter-agent
RESULT=$?
set -e
if [ "${KILN_DEMO_KEEP:-1}" = "0" ]; then
  kill "$SERVE_PID"; wait "$SERVE_PID" 2>/dev/null || true
else
  echo "kiln serve is still running (pid $SERVE_PID): Web UI above; stop it with: kill $SERVE_PID"
fi
exit "$RESULT"
