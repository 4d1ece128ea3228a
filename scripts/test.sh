#!/usr/bin/env bash
# Set everything up and run the test suite in one pytest process.
# The tests start (and stop, by PID) every server they need: Temporal dev server, SeaweedFS,
# example OpenEnv environments. pytest's exit code 5 ("no tests ran") counts as a failure.
# It also installs the vllm engine's CPU build into .venv-vllm (scripts/setup_vllm.sh), so the
# vllm engine's tests run for real; where that install fails they are skipped with a reason, unless
# KILN_REQUIRE_VLLM=1 (CI sets it), which makes a missing engine fail the run.
# The heavy tier (cases marked `heavy`: whole-stack runs of a minute or more) is not in the suite:
# `scripts/test.sh --heavy` runs it alone and `--all` runs both; CI runs the suite, then the tier.
set -uo pipefail
cd "$(dirname "$0")/.."
tier=suite
case "${1:-}" in
  --heavy) tier=heavy; shift ;;
  --all) tier=all; shift ;;
esac
bash scripts/setup.sh || exit 1
if ! KILN_VLLM_BUILD=cpu bash scripts/setup_vllm.sh; then
  if [ "${KILN_REQUIRE_VLLM:-0}" = "1" ]; then
    echo "the vllm engine could not be installed and KILN_REQUIRE_VLLM=1: failing" >&2
    exit 1
  fi
  echo "warning: the vllm engine could not be installed; its tests will be skipped" >&2
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
KILN_TEST_TIER="$tier" python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
