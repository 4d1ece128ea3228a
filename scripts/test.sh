#!/usr/bin/env bash
# Set everything up and run the whole test suite in one pytest process.
# The tests start (and stop, by PID) every server they need: Temporal dev server, SeaweedFS,
# example OpenEnv environments. pytest's exit code 5 ("no tests ran") counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
