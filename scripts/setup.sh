#!/usr/bin/env bash
# Create .venv (Python 3.11) and install Kiln with its training, example-env and test extras.
# torch is pinned to the CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${KILN_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING" || true
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING" || true
python -m pip install -q -e ".[train,envs,trackers,test]" 2>&1 | grep -v "^WARNING" || true
# The run-page browser test uses Debian's chromium (Playwright never downloads a browser here).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "warning: could not install chromium (the run-page browser test needs /usr/bin/chromium)" >&2
fi
# Schema-constrained decoding without the unused ~1 GB triton wheel (see pyproject's extra).
python -m pip install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2" 2>&1 | grep -v "^WARNING" || true
python - <<'PY'
import torch, temporalio, transformers, peft, openenv, xgrammar  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert torch.version.cuda is None, "a CUDA build of torch was installed; expected the CPU wheel"
PY
echo "kiln environment ready in .venv"
